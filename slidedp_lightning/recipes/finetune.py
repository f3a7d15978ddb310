"""``slidedp-finetune`` from the library's side: the strategy its flags ask for, with the job's settings
(:mod:`slidedp_lightning.recipes.settings`) and its LightningModule in one place.

The flags are parsed and checked by the command line, :mod:`slidedp_lightning_cli.finetune`, which imports no
Lightning (``import slidedp_lightning`` does, to register the strategy) and imports this package only to run the
job. The run is :mod:`slidedp_lightning.recipes.job`, the LightningModule
:class:`~slidedp_lightning.recipes.module.FinetuneModule`.
"""

from __future__ import annotations

import argparse

from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from slidedp_lightning import SlideDPStrategy
from slidedp_lightning.process.launcher import TrainerScriptLauncher
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
    "ComparisonDDP",
    "FinetuneModule",
    "check_vocab",
    "checkpoint_vocab_size",
    "chunked_loss",
    "load_tiny_config",
    "strategy_for",
]


class ComparisonDDP(DDPStrategy):
    """Lightning's ``strategy="ddp"`` (script launcher), whose launcher takes over the ranks the command started
    early (:mod:`slidedp_lightning.process.early_ranks`), as SlideDP's does."""

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = TrainerScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)


def strategy_for(args: argparse.Namespace) -> SlideDPStrategy | DDPStrategy | str:
    """The strategy the parsed flags ask for: DDP (:class:`ComparisonDDP`), the registered name, or a SlideDPStrategy
    with the options they set (:func:`~slidedp_lightning.recipes.settings.strategy_options`; the strategy checks
    them as it is made)."""
    if args.strategy == "ddp":
        return ComparisonDDP()
    if args.strategy != "slidedp":
        return args.strategy
    options = strategy_options(args)
    return SlideDPStrategy(**options) if options else args.strategy  # type: ignore[arg-type]
