"""``slidedp-finetune`` from the library's side: the strategy its flags ask for, with the job's settings
(:mod:`slidedp_lightning.recipes.settings`) and its LightningModule in one place.

The flags are parsed and checked by the command line, :mod:`slidedp_lightning_cli.finetune`, which imports no
Lightning (``import slidedp_lightning`` does, to register the strategy) and imports this package only to run the
job. The run is :mod:`slidedp_lightning.recipes.job`, the LightningModule
:class:`~slidedp_lightning.recipes.module.FinetuneModule`.
"""

from __future__ import annotations

import argparse

from slidedp_lightning import SlideDPStrategy
from slidedp_lightning.recipes.module import FinetuneModule, checkpoint_vocab_size, load_tiny_config
from slidedp_lightning.recipes.settings import (
    ACCELERATORS,
    DEFAULT_BATCH_SIZE,
    DEFAULT_CONFIG,
    DEFAULT_DATA_LR,
    DEFAULT_LR,
    DEFAULT_MAX_STEPS,
    DEFAULT_SEED,
    DEFAULT_SEQ_LEN,
    DEFAULT_WEIGHT_DECAY,
    EVAL_BATCH_SIZE,
    EVAL_SEED_OFFSET,
    EVAL_SIZE,
    EXPORT_DTYPES,
    GRAD_ROUTES,
    PARAM_ROUTES,
    PRECISIONS,
    STRATEGIES,
    TASK,
    TRAIN_SIZE,
    check_vocab,
    chunked_loss,
    strategy_options,
)

__all__ = [
    "ACCELERATORS",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_CONFIG",
    "DEFAULT_DATA_LR",
    "DEFAULT_LR",
    "DEFAULT_MAX_STEPS",
    "DEFAULT_SEED",
    "DEFAULT_SEQ_LEN",
    "DEFAULT_WEIGHT_DECAY",
    "EVAL_BATCH_SIZE",
    "EVAL_SEED_OFFSET",
    "EVAL_SIZE",
    "EXPORT_DTYPES",
    "GRAD_ROUTES",
    "PARAM_ROUTES",
    "PRECISIONS",
    "STRATEGIES",
    "TASK",
    "TRAIN_SIZE",
    "FinetuneModule",
    "check_vocab",
    "checkpoint_vocab_size",
    "chunked_loss",
    "load_tiny_config",
    "strategy_for",
]


def strategy_for(args: argparse.Namespace) -> SlideDPStrategy | str:
    """The strategy the parsed flags ask for: the registered name, or a SlideDPStrategy with the options they set
    (:func:`~slidedp_lightning.recipes.settings.strategy_options`; the strategy checks them as it is made)."""
    if args.strategy != "slidedp":
        return args.strategy
    options = strategy_options(args)
    return SlideDPStrategy(**options) if options else args.strategy  # type: ignore[arg-type]
