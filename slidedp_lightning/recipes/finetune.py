"""Fine-tune a causal LM on a synthetic task with PyTorch Lightning.

The job evaluates the model, trains it, evaluates it again and prints the
task's loss and answer-token accuracy before and after.  By default it
random-initializes a tiny Qwen3 from ``configs/qwen3_tiny.json`` and trains
it with ``strategy="slidedp"`` on 2 CPU processes; ``--model DIR`` fine-tunes
a local Hugging Face checkpoint instead, and ``--strategy ddp`` runs the same
job with Lightning's DDP for comparison.

Multi-process strategies on CPU re-run this script (``sys.argv``) once per
extra rank, so call :func:`main` from a script or the ``slidedp-finetune``
console command rather than with a hand-made ``argv`` when ``--devices > 1``.

Run ``slidedp-finetune --help`` for the flags.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader

import slidedp_lightning  # noqa: F401  (registers strategy="slidedp")
from slidedp_lightning import LaneTrace, SaveHuggingFace, SlideDPStrategy
from slidedp_lightning.recipes.synthetic import SyntheticTaskDataset, TaskSpec, answer_accuracy_counts

DEFAULT_CONFIG = "qwen3_tiny.json"

# Task and data-set sizes.  Reversal of 12 symbols out of 60 (vocabulary of
# 64 ids): a random model scores ~1/60 per answer token, a trained tiny model
# close to 1.0.
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
PRECISIONS = ("bf16-mixed", "32-true")
STRATEGIES = ("slidedp", "ddp")
PARAM_ROUTES = ("full", "sharded", "replicated", "auto")
GRAD_ROUTES = ("gpu_reduce", "host_reduce", "auto")
EXPORT_DTYPES = ("bfloat16", "float32")


def _chunk_bytes(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'expected a positive integer or "auto", got {text!r}') from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def load_tiny_config(name: str = DEFAULT_CONFIG) -> tuple[Any, str]:
    """Return ``(Qwen3Config, attn_implementation)`` for a config shipped in ``configs/``."""
    from transformers import Qwen3Config

    text = resources.files("slidedp_lightning.recipes").joinpath("configs", name).read_text()
    data = json.loads(text)
    attn = data.pop("attn_implementation", "sdpa")
    return Qwen3Config.from_dict(data), attn


def checkpoint_vocab_size(model_dir: str) -> int:
    """Vocabulary size of a local Hugging Face checkpoint directory (reads only its config)."""
    from transformers import AutoConfig

    if not os.path.isdir(model_dir):
        raise ValueError(f"{model_dir!r} is not a directory (expected a local Hugging Face checkpoint)")
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text_config.vocab_size)


def check_vocab(vocab_size: int, spec: TaskSpec, where: str) -> None:
    if vocab_size < spec.vocab_size:
        raise ValueError(
            f"{where} has a vocabulary of {vocab_size} token ids but the synthetic task needs "
            f"{spec.vocab_size} (ids 0..{spec.vocab_size - 1}); use a model with a larger vocabulary"
        )


class FinetuneModule(L.LightningModule):
    """Causal-LM fine-tuning on :class:`~slidedp_lightning.recipes.synthetic.SyntheticTaskDataset`.

    The model is built in :meth:`configure_model` (idempotent), not in
    ``__init__``, so strategies can control where and how it is created.
    """

    def __init__(
        self,
        model_dir: str | None = None,
        config_name: str = DEFAULT_CONFIG,
        task: str = TASK.task,
        num_symbols: int = TASK.num_symbols,
        length: int = TASK.length,
        train_size: int = TRAIN_SIZE,
        eval_size: int = EVAL_SIZE,
        batch_size: int = DEFAULT_BATCH_SIZE,
        eval_batch_size: int = EVAL_BATCH_SIZE,
        lr: float = DEFAULT_LR,
        weight_decay: float = DEFAULT_WEIGHT_DECAY,
        warmup_steps: int | None = None,
        seed: int = DEFAULT_SEED,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.spec = TaskSpec(task=task, num_symbols=num_symbols, length=length)
        self.model: torch.nn.Module | None = None
        self._nonfinite_steps: torch.Tensor | None = None  # count, kept on the loss's device (no per-step sync)
        self._train_set: SyntheticTaskDataset | None = None
        self._eval_set: SyntheticTaskDataset | None = None

    @property
    def hp(self) -> Any:
        """The saved hyperparameters (attribute access)."""
        return self.hparams

    # ----------------------------------------------------------------- model
    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        hp = self.hp
        # Same weights on every rank, whatever RNG state the caller left.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(hp.seed)
            if hp.model_dir is not None:  # under SlideDP: a meta skeleton, the checkpoint read into the ledger
                model: Any = slidedp_lightning.from_pretrained(hp.model_dir, attn_implementation="sdpa")
            else:
                config, attn = load_tiny_config(hp.config_name)
                model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
        self.check_model(model)
        model.train()  # from_pretrained returns the model in eval mode
        if getattr(model.config, "use_cache", False):
            model.config.use_cache = False
        self.model = model

    def check_model(self, model: Any) -> None:
        """Refuse a model whose vocabulary the data cannot use."""
        vocab = model.get_input_embeddings().num_embeddings
        check_vocab(vocab, self.spec, self.hp.model_dir or self.hp.config_name)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ):
        assert self.model is not None, "configure_model() has not run"
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False)

    # ------------------------------------------------------------------ data
    def train_set(self) -> SyntheticTaskDataset:
        if self._train_set is None:
            self._train_set = SyntheticTaskDataset(self.spec, self.hp.train_size, seed=self.hp.seed)
        return self._train_set

    def eval_set(self) -> SyntheticTaskDataset:
        if self._eval_set is None:
            seed = self.hp.seed + EVAL_SEED_OFFSET
            self._eval_set = SyntheticTaskDataset(self.spec, self.hp.eval_size, seed=seed)
        return self._eval_set

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(self.hp.seed)
        return DataLoader(self.train_set(), batch_size=self.hp.batch_size, shuffle=True, drop_last=True, generator=gen)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.eval_set(), batch_size=self.hp.eval_batch_size, shuffle=False)

    @property
    def nonfinite_loss_steps(self) -> int:
        """Training steps on this rank whose loss was NaN or inf."""
        return 0 if self._nonfinite_steps is None else int(self._nonfinite_steps.item())

    # -------------------------------------------------------------- training
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(**batch).loss
        bad = (~torch.isfinite(loss.detach())).long()
        self._nonfinite_steps = bad if self._nonfinite_steps is None else self._nonfinite_steps + bad
        self.log("train_loss", loss, prog_bar=True, sync_dist=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        out = self(**batch)
        correct, total, exact = answer_accuracy_counts(out.logits, batch["labels"])
        n = batch["input_ids"].shape[0]
        # Every example has the same number of answer tokens, so batch-size
        # weighted means of these per-batch values are exact over the set.
        self.log("val_loss", out.loss, sync_dist=True, batch_size=n)
        self.log("val_acc", correct.float() / total.clamp_min(1), prog_bar=True, sync_dist=True, batch_size=n)
        self.log("val_exact", exact.float() / n, sync_dist=True, batch_size=n)

    def configure_optimizers(self):
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            is_norm_or_bias = p.ndim < 2 or "norm" in name.lower() or name.endswith(".bias")
            (no_decay if is_norm_or_bias else decay).append(p)
        groups = [
            {"params": decay, "weight_decay": self.hp.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.hp.lr, betas=(0.9, 0.95))

        total = self.trainer.max_steps
        if total is None or total < 0:
            total = int(self.trainer.estimated_stepping_batches)
        total = max(1, int(total))
        warmup = self.hp.warmup_steps
        if warmup is None:
            warmup = max(1, total // 10)
        warmup = max(0, min(int(warmup), total))

        def lr_lambda(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}


# ---------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slidedp-finetune",
        description=(
            f"Train a causal LM on a synthetic task ({TASK.task} {TASK.length} of {TASK.num_symbols} symbols) "
            "and report answer-token loss/accuracy before and after."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="local Hugging Face checkpoint directory to fine-tune; default: random-init tiny Qwen3 "
        f"from configs/{DEFAULT_CONFIG}",
    )
    p.add_argument(
        "--data",
        metavar="FILE",
        default=None,
        help="JSONL training data, one {prompt, completion} or {messages: [{role, content}, ...]} object a line "
        "(needs --model: its tokenizer and chat template; loss on completion / assistant tokens only); "
        "default: the synthetic task",
    )
    p.add_argument("--val-data", metavar="FILE", default=None, help="JSONL validation data (default: --data)")
    p.add_argument(
        "--seq-len",
        type=int,
        default=256,
        help="--data only: tokens per row; each example is its own row, right-padded (no packing); "
        "an example longer than this is refused with its file and line",
    )
    p.add_argument(
        "--export",
        metavar="OUT",
        default=None,
        help="--data only: write the trained model and the tokenizer to OUT (save_pretrained directory)",
    )
    p.add_argument(
        "--export-dtype",
        default=None,
        choices=EXPORT_DTYPES,
        help="dtype of --export (default: float32 with --precision 32-true, else bfloat16)",
    )
    p.add_argument("--results", metavar="FILE", default=None, help="write the before/after metrics as JSON here")
    p.add_argument("--devices", type=int, default=2, help="number of processes/devices")
    p.add_argument("--accelerator", default="cpu", help='Lightning accelerator ("cpu", "gpu", ...)')
    p.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS)
    p.add_argument("--strategy", default="slidedp", choices=STRATEGIES)
    p.add_argument(
        "--trace-dir",
        default=None,
        help="slidedp only: record the lanes (TensorBoard scalars + Gantt, Chrome trace) under this folder",
    )
    p.add_argument(
        "--param-route", default="full", choices=PARAM_ROUTES, help="slidedp only: how parameters reach the devices"
    )
    p.add_argument(
        "--grad-route",
        default="gpu_reduce",
        choices=GRAD_ROUTES,
        help="slidedp only: how gradients are reduced and returned to the host",
    )
    p.add_argument(
        "--chunk-bytes",
        type=_chunk_bytes,
        default=None,
        help='slidedp only: gradient chunk size in bytes, or "auto" (default: whole units)',
    )
    p.add_argument("--max-steps", type=int, default=DEFAULT_MAX_STEPS, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="examples per device per step")
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"peak AdamW learning rate (default: {DEFAULT_LR:g}, {DEFAULT_DATA_LR:g} with --data)",
    )
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up steps (default: 10%% of --max-steps)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--log-dir", default=os.path.join("runs", "finetune"), help="TensorBoard log directory")
    return p


def _writable_file(flag: str, path: str) -> str | None:
    """Why ``path`` cannot be written as a file (one line), or None."""
    if os.path.isdir(path):
        return f"{flag} {path} is a directory: pass a file path"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"{flag} {path}: the directory {parent} does not exist"
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"{flag} {path} cannot be written (permissions)"
    return None


def _writable_dir(flag: str, path: str) -> str | None:
    """Why a directory cannot be created or written at ``path`` (one line), or None."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{flag} {path} exists and is not a directory: choose a directory path"
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        return f"{flag} {path} cannot be created or written: {probe} is not a writable directory"
    return None


def check_outputs(args: argparse.Namespace) -> str | None:
    """Why one of the run's output paths cannot be written (one line naming the flag, the cause and the fix), or
    None: checked before training, so that a run's weights are never trained and then lost."""
    from slidedp_lightning.export import check_export_target

    if args.export:
        try:
            check_export_target(args.export)
        except OSError as err:
            return f"--export {args.export}: {err}"
        if args.results and os.path.abspath(args.results).startswith(os.path.abspath(args.export) + os.sep):
            return f"--results {args.results} is inside --export {args.export}, which the export replaces"
    for flag, value, check in (
        ("--results", args.results, _writable_file),
        ("--log-dir", args.log_dir, _writable_dir),
        ("--trace-dir", args.trace_dir, _writable_dir),
    ):
        problem = check(flag, value) if value else None
        if problem is not None:
            return problem
    return None


def strategy_for(args: argparse.Namespace) -> SlideDPStrategy | str:
    """The strategy the parsed flags ask for (a configured SlideDPStrategy, or the registered name)."""
    custom = (args.param_route, args.grad_route, args.chunk_bytes) != ("full", "gpu_reduce", None)
    if args.strategy != "slidedp" or not custom:
        return args.strategy
    return SlideDPStrategy(param_route=args.param_route, grad_route=args.grad_route, chunk_bytes=args.chunk_bytes)


@rank_zero_only
def _report(lines: Sequence[str]) -> None:
    print("\n".join(lines), flush=True)


def _metrics(results: Sequence[Mapping[str, float]]) -> dict[str, float]:
    m = results[0] if results else {}
    return {k: float(m.get(k, float("nan"))) for k in ("val_loss", "val_acc", "val_exact")}


def main(argv: Sequence[str] | None = None) -> int:
    # own_data builds on FinetuneModule: imported here, not at the top (no import cycle)
    from slidedp_lightning.recipes.data import DataError
    from slidedp_lightning.recipes.own_data import DataFinetuneModule, TokenThroughput, export

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_steps < 1:
        parser.error("--max-steps must be >= 1")
    if args.trace_dir and args.strategy != "slidedp":
        parser.error("--trace-dir traces SlideDP's lanes: use it with --strategy slidedp")
    custom = (args.param_route, args.grad_route, args.chunk_bytes) != ("full", "gpu_reduce", None)
    if custom and args.strategy != "slidedp":
        parser.error(
            "--param-route, --grad-route and --chunk-bytes configure SlideDP: use them with --strategy slidedp"
        )
    if args.data is None and (args.val_data or args.export or args.export_dtype):
        parser.error("--val-data, --export and --export-dtype go with --data")
    if args.data is not None and args.model is None:
        parser.error("--data needs --model DIR: the tokenizer and chat template come from DIR")
    if args.seq_len < 2:
        parser.error("--seq-len must be >= 2")
    if args.model is not None and args.data is None:
        try:
            check_vocab(checkpoint_vocab_size(args.model), TASK, args.model)
        except (OSError, ValueError) as err:
            parser.error(f"--model {args.model}: {err}")
    problem = check_outputs(args)
    if problem is not None:  # before any process starts or any step trains: the run's weights must have a place
        parser.error(problem)

    # Known, harmless Lightning hints: the data are small in-memory tensors, and
    # the eval set size is a multiple of the default world size.
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*it is recommended to use `Trainer\(devices=1.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")

    L.seed_everything(args.seed, workers=True, verbose=False)
    module: FinetuneModule
    if args.data is not None:
        try:
            module = DataFinetuneModule(
                model_dir=args.model,
                data=args.data,
                val_data=args.val_data,
                seq_len=args.seq_len,
                batch_size=args.batch_size,
                lr=DEFAULT_DATA_LR if args.lr is None else args.lr,
                warmup_steps=args.warmup_steps,
                seed=args.seed,
            )
        except (DataError, OSError, ValueError) as err:  # before any process is started
            print(f"slidedp-finetune: error: {err}", file=sys.stderr, flush=True)
            return 2
    else:
        module = FinetuneModule(
            model_dir=args.model,
            batch_size=args.batch_size,
            lr=DEFAULT_LR if args.lr is None else args.lr,
            warmup_steps=args.warmup_steps,
            seed=args.seed,
        )
    export_dtype = getattr(torch, args.export_dtype or ("float32" if args.precision == "32-true" else "bfloat16"))
    export_cb = [SaveHuggingFace(args.export, export_dtype)] if args.export and args.strategy == "slidedp" else []
    logger = TensorBoardLogger(save_dir=args.log_dir, name="", default_hp_metric=False)
    trainer = L.Trainer(
        strategy=strategy_for(args),
        accelerator=args.accelerator,
        devices=args.devices,
        precision=args.precision,
        max_steps=args.max_steps,
        logger=logger,
        callbacks=[
            LearningRateMonitor(logging_interval="step"),
            TokenThroughput(),
            *([LaneTrace(args.trace_dir)] if args.trace_dir else []),
            *export_cb,
        ],
        use_distributed_sampler=args.data is None,  # --data: the module shards its own data
        enable_checkpointing=False,
        log_every_n_steps=10,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=None,
        val_check_interval=max(1, args.max_steps // 4),
        enable_progress_bar=True,
        enable_model_summary=True,
    )

    t0 = time.perf_counter()
    before = _metrics(trainer.validate(module, verbose=False))
    t1 = time.perf_counter()
    trainer.fit(module)
    t2 = time.perf_counter()
    last = trainer.callback_metrics.get("train_loss")  # last step's, synced across ranks
    train_loss = float(last) if last is not None else float("nan")
    if args.export and isinstance(module, DataFinetuneModule):
        export(trainer, module, args.export, export_dtype)
    after = _metrics(trainer.validate(module, verbose=False))
    t3 = time.perf_counter()
    finite = module.nonfinite_loss_steps == 0 and math.isfinite(train_loss) and math.isfinite(after["val_loss"])

    world = trainer.world_size
    if args.results and trainer.is_global_zero:
        with open(args.results, "w") as f:
            json.dump({"before": before, "after": after, "train_loss": train_loss, "steps": trainer.global_step}, f)
    task = f"{TASK.task} {TASK.length} symbols of {TASK.num_symbols}" if args.data is None else f"{args.data}"
    _report(
        [
            "",
            f"task: {task} | model: {args.model or DEFAULT_CONFIG} | "
            f"strategy: {args.strategy} x{world} | precision: {args.precision} | steps: {trainer.global_step} | "
            f"global batch: {args.batch_size * world}",
            f"{'':8s}{'loss':>9s}{'acc':>8s}{'exact':>8s}",
            f"{'before':8s}{before['val_loss']:9.4f}{before['val_acc']:8.3f}{before['val_exact']:8.3f}",
            f"{'after':8s}{after['val_loss']:9.4f}{after['val_acc']:8.3f}{after['val_exact']:8.3f}",
            f"before: loss {before['val_loss']:.3f} acc {before['val_acc']:.3f} | "
            f"after: loss {after['val_loss']:.3f} acc {after['val_acc']:.3f} | last train_loss {train_loss:.4f}",
            f"time: eval {t1 - t0:.1f}s, fit {t2 - t1:.1f}s, eval {t3 - t2:.1f}s",
            f"TensorBoard logs: {logger.log_dir}",
            *([f"exported ({args.export_dtype or export_dtype}): {args.export}"] if args.export else []),
        ]
    )
    # leave no gloo/NCCL threads to static destructors at interpreter exit (they can abort the process)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if not finite:
        _report(
            [
                f"ERROR: non-finite loss (non-finite training steps on rank 0: {module.nonfinite_loss_steps}, "
                f"last train_loss {train_loss}, val_loss {after['val_loss']})"
            ]
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
