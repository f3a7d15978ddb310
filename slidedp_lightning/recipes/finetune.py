"""``slidedp-finetune`` from the library's side: the strategy its flags ask for, with the command line's names and
the job's LightningModule in one place.

The flags are parsed and checked in :mod:`slidedp_lightning_cli.finetune`, outside this package, so that
``--help`` and a refused flag never import Lightning (``import slidedp_lightning`` does, to register the strategy);
its names are re-exported here. The run is :mod:`slidedp_lightning.recipes.job`, the LightningModule
:class:`~slidedp_lightning.recipes.module.FinetuneModule`.
"""

from __future__ import annotations

import argparse

from slidedp_lightning import SlideDPStrategy
from slidedp_lightning.recipes.module import FinetuneModule, checkpoint_vocab_size, load_tiny_config
from slidedp_lightning_cli.finetune import (
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
    build_parser,
    check_args,
    check_outputs,
    check_vocab,
    config_vocab_size,
    custom_routes,
    main,
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
    "build_parser",
    "check_args",
    "check_outputs",
    "check_vocab",
    "checkpoint_vocab_size",
    "config_vocab_size",
    "custom_routes",
    "load_tiny_config",
    "main",
    "strategy_for",
]


def strategy_for(args: argparse.Namespace) -> SlideDPStrategy | str:
    """The strategy the parsed flags ask for: the registered name, or a configured SlideDPStrategy. The synthetic
    task's random-init model is built on the meta device (``meta_init``: each unit initialized straight into the
    ledger, no rank holding the whole model), as SlideDP advises for random weights."""
    if args.strategy != "slidedp":
        return args.strategy
    meta_init = args.model is None
    if not custom_routes(args) and not meta_init:
        return args.strategy
    return SlideDPStrategy(
        param_route=args.param_route, grad_route=args.grad_route, chunk_bytes=args.chunk_bytes, meta_init=meta_init
    )
