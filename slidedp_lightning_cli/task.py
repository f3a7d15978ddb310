"""The synthetic task's shape and token ids (plain Python: the CLI reads them before it imports anything heavy);
the data and the metric are in :mod:`slidedp_lightning.recipes.synthetic`, which re-exports these names."""

from __future__ import annotations

from dataclasses import dataclass

IGNORE_INDEX = -100

PAD_ID = 0
BOS_ID = 1
SEP_ID = 2
EOS_ID = 3
NUM_SPECIAL_TOKENS = 4

TASKS = ("reverse", "sort", "copy")


@dataclass(frozen=True)
class TaskSpec:
    """Shape of the synthetic task."""

    task: str = "reverse"
    num_symbols: int = 60
    length: int = 12

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; choose one of {TASKS}")
        if self.num_symbols < 2:
            raise ValueError(f"num_symbols must be >= 2, got {self.num_symbols}")
        if self.length < 1:
            raise ValueError(f"length must be >= 1, got {self.length}")

    @property
    def vocab_size(self) -> int:
        """Number of token ids the task uses (specials + symbols)."""
        return NUM_SPECIAL_TOKENS + self.num_symbols

    @property
    def seq_len(self) -> int:
        """Tokens per example: BOS + k prompt symbols + SEP + k answer symbols."""
        return 2 * self.length + 2

    @property
    def prompt_len(self) -> int:
        """Tokens per example that belong to the prompt (BOS, symbols, SEP)."""
        return self.length + 2
