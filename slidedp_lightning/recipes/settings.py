"""The fine-tuning job's settings: the synthetic task's shape and token ids, the defaults and choices of every flag
of ``slidedp-finetune``, and the checks that need nothing but them.

Plain Python (the standard library only): ``slidedp-finetune`` reads it before it imports anything heavy, straight
from this file (:mod:`slidedp_lightning_cli.task`), since importing it through this package would run
``slidedp_lightning/__init__.py``, which imports Lightning and torch to register the strategy.
"""

from __future__ import annotations

from argparse import Namespace
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


DEFAULT_CONFIG = "qwen3_tiny.json"

# Task and data-set sizes.  Reversal of 12 symbols out of 60 (vocabulary of 64 ids): a random model scores ~1/60 per
# answer token, a trained tiny model close to 1.0.
TASK = TaskSpec(task="reverse", num_symbols=60, length=12)
TRAIN_SIZE = 20_000
EVAL_SIZE = 1_024
EVAL_BATCH_SIZE = 256
EVAL_SEED_OFFSET = 1_000_003  # eval examples come from a different random stream

# Defaults (tuned on 2 CPU cores, 2 ranks).
DEFAULT_MAX_STEPS = 200
DEFAULT_BATCH_SIZE = 32  # per rank
DEFAULT_LR = 3e-3
DEFAULT_DATA_LR = 1e-5  # --data: a pretrained checkpoint
DEFAULT_WEIGHT_DECAY = 0.01
DEFAULT_SEED = 1234
DEFAULT_SEQ_LEN = 256
PRECISIONS = ("bf16-mixed", "16-mixed", "32-true")
STRATEGIES = ("slidedp", "ddp")
ACCELERATORS = ("cpu", "cuda", "gpu", "auto")
PARAM_ROUTES = ("full", "sharded", "replicated", "auto")
GRAD_ROUTES = ("gpu_reduce", "host_reduce", "auto")
EXPORT_DTYPES = ("bfloat16", "float32")
MIN_CHUNK_BYTES = 64  # the engine's smallest gradient chunk (slidedp_lightning.runtime.config.EngineConfig)


def check_vocab(vocab_size: int, spec: TaskSpec, where: str) -> None:
    """Raise ``ValueError`` (naming ``where`` and the fix) when a vocabulary of ``vocab_size`` ids cannot hold
    the task's token ids."""
    if vocab_size < spec.vocab_size:
        raise ValueError(
            f"{where} has a vocabulary of {vocab_size} token ids but the synthetic task needs "
            f"{spec.vocab_size} (ids 0..{spec.vocab_size - 1}); use a model with a larger vocabulary"
        )


def custom_routes(args: Namespace) -> bool:
    """Whether the flags change SlideDP's routes or gradient chunks from the strategy's defaults."""
    return (args.param_route, args.grad_route, args.chunk_bytes) != ("full", "gpu_reduce", None)
