"""Example recipes built on the slidedp strategy.

* :mod:`slidedp_lightning.recipes.synthetic`: a seed-deterministic synthetic
  sequence task (data set and answer-token accuracy); its shape in :mod:`slidedp_lightning.recipes.settings`.
* :mod:`slidedp_lightning.recipes.finetune`: the fine-tuning job (``slidedp-finetune`` command,
  ``experiments/finetune.py``) from the library's side: the strategy its flags ask for, and the command line's
  names, which :mod:`slidedp_lightning_cli.finetune` parses and checks without importing Lightning;
  :mod:`slidedp_lightning.recipes.module` its LightningModule, :mod:`slidedp_lightning.recipes.job` the run
  (one ``Trainer.fit``).
* :mod:`slidedp_lightning.recipes.data`: JSONL prompt/completion and chat data (``--data``): checks, label
  masks, padded rows.
* :mod:`slidedp_lightning.recipes.own_data`: the fine-tuning module for that data, tokens/s logging, export.

The package's names (the synthetic task's) are imported when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slidedp_lightning.recipes.settings import TaskSpec
    from slidedp_lightning.recipes.synthetic import SyntheticTaskDataset, answer_accuracy

__all__ = ["SyntheticTaskDataset", "TaskSpec", "answer_accuracy"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from slidedp_lightning.recipes import synthetic

        return getattr(synthetic, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
