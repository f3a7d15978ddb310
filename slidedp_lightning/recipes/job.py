"""The run behind ``slidedp-finetune`` (:func:`run`, called by :func:`slidedp_lightning_cli.finetune.main` once
the flags are checked): one ``Trainer.fit``, so one launch of the rank processes, one process group, one ledger and
one checkpoint read.

The "before" evaluation is Lightning's sanity check over the whole validation set (``num_sanity_val_steps=-1``);
the "after" one is the validation pass at the last step (:class:`BeforeAfter` asks Lightning for it). Both keep the
module's :attr:`~slidedp_lightning.recipes.module.FinetuneModule.val_metrics`. The output is kept to what the user
needs: rank 0 only, none of Lightning's hardware and tip lines, a step bar on a terminal only (elsewhere one log
line per evaluation), and the before/after table last.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import TensorBoardLogger

from slidedp_lightning import LaneTrace, SaveHuggingFace, SlideDPPrecision
from slidedp_lightning.process.requeue import SaveAndStopAtStepEnd
from slidedp_lightning.recipes.finetune import (
    DEFAULT_CONFIG,
    DEFAULT_DATA_LR,
    DEFAULT_LR,
    DEFAULT_MAX_STEPS,
    TASK,
    chunked_loss,
    strategy_for,
)
from slidedp_lightning.recipes.host_memory import PeakHostMemory
from slidedp_lightning.recipes.module import FinetuneModule
from slidedp_lightning.recipes.plan import of_flags as plan_of_flags
from slidedp_lightning.recipes.settings import (
    MODEL_ACTIVATION_POLICY,
    MODEL_CHUNKED_LOSS,
    bf16_note,
    latest_checkpoint,
    lora_settings,
    resolved_config,
)

log = logging.getLogger(__name__)

METRICS = ("val_loss", "val_acc", "val_exact")
# Lightning's lines that say nothing about this job (its hardware table, tips, the fit's end, the process-group
# block after the "Initializing distributed" banner, the AMP notice: the table states the precision)
_DROPPED = (
    "GPU available",
    "TPU available",
    "HPU available",
    "\N{ELECTRIC LIGHT BULB} Tip",
    "`Trainer.fit` stopped",
    "----------",
    "Using bfloat16 Automatic Mixed Precision",
    "Using 16bit Automatic Mixed Precision",
    "`Trainer(val_check_interval=1)` was configured",  # the job's --val-every 1 (or a short --max-steps)
)


class _DropLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).lstrip().startswith(_DROPPED)


def _launching_process() -> bool:
    """Whether this is global rank 0's process, the one that launches the others (they get LOCAL_RANK or
    NODE_RANK set): it alone logs the job's decisions and writes its files."""
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


def quiet_logs() -> None:
    """Rank 0 keeps one "Initializing distributed" banner and SlideDP's setup lines; the other ranks log
    warnings only (they would repeat rank 0's lines)."""
    drop = _DropLines()
    for name in ("lightning.pytorch", "lightning.fabric"):
        for logger in (logging.getLogger(name), logging.getLogger(f"{name}.utilities.rank_zero")):
            logger.addFilter(drop)
            for handler in logger.handlers:
                handler.addFilter(drop)
    if not _launching_process():
        for name in ("lightning.pytorch", "lightning.fabric", "slidedp_lightning"):
            logging.getLogger(name).setLevel(logging.WARNING)
    # known, harmless Lightning hints: the data are small in-memory tensors, the eval set size is a multiple of the
    # default world size
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*it is recommended to use `Trainer\(devices=1.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")


def _nan_metrics() -> dict[str, float]:
    return dict.fromkeys(METRICS, float("nan"))


class BeforeAfter(L.Callback):
    """Keeps the metrics of the sanity check (``before``: the whole validation set before the first step) and of the
    last step's validation pass (``after``), with their times; makes Lightning validate at the last step (it
    validates every ``val_check_interval`` steps, which need not divide ``max_steps``). Without a progress bar
    (``report=True``) rank 0 logs one line per evaluation."""

    def __init__(self, report: bool) -> None:
        self.report = report
        self.before: dict[str, float] = _nan_metrics()
        self.after: dict[str, float] = _nan_metrics()
        self.after_step = -1
        self.seconds = {"before": float("nan"), "after": float("nan")}
        self._t0 = 0.0

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._t0 = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        took = time.perf_counter() - self._t0
        metrics = dict(getattr(pl_module, "val_metrics", None) or _nan_metrics())
        if trainer.sanity_checking:
            self.before, self.seconds["before"] = metrics, took
            where = "before training"
        else:
            self.after, self.seconds["after"], self.after_step = metrics, took, trainer.global_step
            train_loss = trainer.callback_metrics.get("train_loss")
            where = f"step {trainer.global_step}/{trainer.max_steps}" + (
                f", train_loss {float(train_loss):.4f}" if train_loss is not None else ""
            )
        if self.report and trainer.is_global_zero:
            log.info(
                "%s: val_loss %.4f, val_acc %.3f, val_exact %.3f (%.1f s)",
                where,
                metrics["val_loss"],
                metrics["val_acc"],
                metrics["val_exact"],
                took,
            )

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if 0 < trainer.max_steps <= trainer.global_step:
            trainer.should_stop = True  # Lightning validates on this batch, then stops (max_steps)


class LedgerFacts(L.Callback):
    """The host ledger's size at the end of training (SlideDP only): ``ledger_bytes`` and ``ledger_bytes_per_param``
    (every region, padding and guards included, over the model's parameters); with ``--trace-dir``,
    ``exposed_host_share``: the median over the traced steps (the first left out) of the share of rank 0's step
    that its compute thread did not compute (waiting on the host's lanes, or between units)."""

    def __init__(self) -> None:
        self.facts: dict[str, float | int | None] = {
            "ledger_bytes": None,
            "ledger_bytes_per_param": None,
            "exposed_host_share": None,
        }

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is None:
            return
        stats = engine.ledger_stats()
        self.facts |= {"ledger_bytes": stats.nbytes, "ledger_bytes_per_param": stats.nbytes / stats.num_params}
        traced = [m for step, m in sorted(engine.tracer.metrics.items()) if step > 0 and m["step_time"] > 0]
        if traced:
            self.facts["exposed_host_share"] = statistics.median(m["exposed_host"] / m["step_time"] for m in traced)


class StepBar(TQDMProgressBar):
    """Lightning's bar counting optimizer steps to ``max_steps`` (not batches of an epoch), without ``v_num``;
    the sanity check shows as the evaluation before training."""

    @property
    def sanity_check_description(self) -> str:
        return "Evaluating before training"

    @property
    def validation_description(self) -> str:
        return "Evaluating"

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        if trainer.current_epoch == 0 or self.train_progress_bar.total != trainer.max_steps:
            self.train_progress_bar.reset(total=trainer.max_steps)
            self.train_progress_bar.initial = 0
            self.train_progress_bar.set_description("Training")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        bar = self.train_progress_bar
        if self._should_update(trainer.global_step, trainer.max_steps):
            bar.n = trainer.global_step
            bar.set_postfix(self.get_metrics(trainer, pl_module))
            bar.refresh()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, int | str | float | dict]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics


def _module(args: argparse.Namespace) -> FinetuneModule:
    if args.data is None:
        return FinetuneModule(
            model_dir=args.model,
            batch_size=args.batch_size,
            lr=DEFAULT_LR if args.lr is None else args.lr,
            weight_decay=args.weight_decay,
            warmup_steps=args.warmup_steps,
            seed=args.seed,
            lr_schedule=args.lr_schedule,
            chunked_loss=chunked_loss(args),
            lora=lora_settings(args),
        )
    from slidedp_lightning.recipes.own_data import DataFinetuneModule

    return DataFinetuneModule(
        model_dir=args.model,
        data=args.data,
        val_data=args.val_data,
        val_split=args.val_split,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        lr=DEFAULT_DATA_LR if args.lr is None else args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        seed=args.seed,
        lr_schedule=args.lr_schedule,
        chunked_loss=chunked_loss(args),
        lora=lora_settings(args),
        pack=args.pack,
        truncate=args.truncate,
    )


def _version() -> str:
    """The package's version and, in a git checkout, its commit (and whether the tree differs from it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = f"slidedp-lightning {version('slidedp-lightning')}"
    except PackageNotFoundError:
        text = "slidedp-lightning (not installed)"
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        git = ["git", "-C", here]
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return f"{text}, not a git checkout"
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return f"{text}, commit unknown (git did not answer)"
    return f"{text}, commit {head.stdout.strip()}" + (" with uncommitted changes" if dirty else "")


def write_run_config(args: argparse.Namespace, directory: str) -> str:
    """Write the run's resolved settings to ``directory/config.yaml`` (``--config`` reads it back) with the
    package's version and commit; returns the path."""
    import yaml

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "config.yaml")
    head = f"# slidedp-finetune --config {path} repeats this run\n# {_version()}\n"
    with open(path, "w") as f:
        f.write(head + yaml.safe_dump(resolved_config(args), sort_keys=False))
    return path


class StepCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` every ``every_n_train_steps`` steps that also saves the run's last step,
    ``last_step``, when that is not a multiple of it: a run always ends with its final state on disk."""

    def __init__(self, *, last_step: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.last_step = last_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        every = self._every_n_train_steps
        if trainer.global_step == self.last_step and every > 0 and trainer.global_step % every:
            self._every_n_train_steps = trainer.global_step  # a multiple of itself: the base class saves this step
        try:
            super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        finally:
            self._every_n_train_steps = every


def _checkpoints(args: argparse.Namespace, max_steps: int) -> list[L.Callback]:
    """The checkpoint callbacks of ``--checkpoint-dir``: ``step=N.ckpt`` every ``--checkpoint-every`` steps and at
    the last step (without it, one at ``--max-steps``), the newest ``--keep-last`` kept; and one at the end of the
    step in which SIGTERM (or SIGUSR1, SLURM's requeue signal) arrived, after which the job stops (SlideDP)."""
    if args.checkpoint_dir is None:
        return []
    every = args.checkpoint_every or max_steps
    return [
        SaveAndStopAtStepEnd(lambda step: os.path.join(args.checkpoint_dir, f"step={step}.ckpt")),
        StepCheckpoint(
            last_step=max_steps,
            dirpath=args.checkpoint_dir,
            filename="step={step}",
            auto_insert_metric_name=False,
            every_n_train_steps=every,
            save_top_k=args.keep_last,
            monitor="step",
            mode="max",
        ),
    ]


def _resume_from(args: argparse.Namespace) -> str | None:
    if args.resume is None:
        return None
    path = latest_checkpoint(args.checkpoint_dir) if args.resume == "auto" else args.resume
    if _launching_process():
        if path is None:
            log.info("--resume auto: no checkpoint under %s yet, a fresh start", args.checkpoint_dir)
        else:
            log.info("resuming from %s", path)
    return path


def _max_steps(args: argparse.Namespace, module: FinetuneModule) -> int:
    """The run's optimizer steps: ``--max-steps``, or ``--max-epochs`` passes over the training data (a partial
    accumulation at an epoch's end is a step, as Lightning takes it), or the default."""
    if args.max_epochs is None:
        return args.max_steps or DEFAULT_MAX_STEPS
    per_epoch = math.ceil(module.batches_per_epoch(args.devices) / args.accumulate_grad_batches)
    if _launching_process():
        log.info(
            "--max-epochs %d: %d optimizer steps (%d an epoch)", args.max_epochs, args.max_epochs * per_epoch, per_epoch
        )
    return args.max_epochs * per_epoch


def _log_model_defaults(args: argparse.Namespace) -> None:
    """Say which memory savings a real model (``--model``) got by default, and the flag that turns each off."""
    if args.model is None or not _launching_process():
        return
    chosen = []
    if args.activation_policy is None and args.strategy == "slidedp":
        chosen.append(f"activation policy {MODEL_ACTIVATION_POLICY!r} (--activation-policy none turns it off)")
    if args.chunked_loss is None:
        chosen.append(f"the loss in chunks of {MODEL_CHUNKED_LOSS} tokens (--chunked-loss 0 turns it off)")
    if chosen:
        log.info("--model %s: %s", args.model, "; ".join(chosen))


def _log_precision(args: argparse.Namespace) -> None:
    """Say why the job computes in FP32 on a CPU without fast bf16, or what bf16 asked for there costs."""
    note = bf16_note(args, chosen=getattr(args, "precision_chosen", True))
    if note is not None and _launching_process():
        (log.warning if getattr(args, "precision_chosen", True) else log.info)("%s", note)


def _log_data(args: argparse.Namespace, module: FinetuneModule) -> None:
    """Say what --truncate left out and what --pack made of the training examples."""
    from slidedp_lightning.recipes.own_data import DataFinetuneModule

    if not isinstance(module, DataFinetuneModule) or not _launching_process():
        return
    for path, part in ((args.data, module.train_examples), (args.val_data, module.val_data)):
        if path and part.truncated:
            log.info(
                "%s: %d examples cut to their first %d tokens (--truncate), %d of them left out (no loss token left)",
                path, part.truncated, args.seq_len, part.dropped,
            )  # fmt: skip
    if args.pack:
        facts = module.packing_facts()
        log.info(
            "--pack: %d examples in %d rows of %d tokens, %.2fx the tokens a step of one example a row "
            "(%.0f%% of the row tokens not padding)",
            len(module.train_examples), len(module.train_data), args.seq_len, facts["pack_factor"],
            100 * facts["row_fill"],
        )  # fmt: skip


def _plan(args: argparse.Namespace) -> dict[str, object] | None:
    """The job's plan (:mod:`~slidedp_lightning.recipes.plan`; SlideDP only), logged in one line as the run's
    first."""
    if args.strategy != "slidedp" or not _launching_process():  # the others neither log nor report it
        return None
    try:
        job = plan_of_flags(args)
    except (OSError, ValueError) as err:  # a config the plan cannot read: the run goes on without one
        log.info("no plan: %s", " ".join(str(err).split()))
        return None
    log.info("%s (--dry-run: the whole plan)", job.summary())
    return job.as_dict()


def _precision(args: argparse.Namespace) -> dict[str, Any]:
    """The Trainer's precision arguments: on the CPU Lightning turns "16-mixed" into bf16, so SlideDP's own plugin
    is passed for it there."""
    if args.precision == "16-mixed" and args.accelerator == "cpu":
        return {"plugins": [SlideDPPrecision("16-mixed")]}
    return {"precision": args.precision}


def _memory_line(memory: PeakHostMemory, facts: dict[str, float | int | None]) -> str:
    """The end-of-run line on host memory and the host work the step left exposed."""
    gib = 1024**3
    parts = [
        f"peak host memory {memory.peak_bytes / gib:.2f} GiB ({memory.processes} processes, PSS, a sample every"
        f" {memory.longest_wait_s:.2g} s or less)"
        if memory.peak_bytes
        else "peak host memory not measured"
    ]
    if facts["ledger_bytes"] is not None:
        parts.append(f"ledger {facts['ledger_bytes'] / gib:.2f} GiB ({facts['ledger_bytes_per_param']:.2f} B/param)")
    if facts["exposed_host_share"] is not None:
        parts.append(f"host work exposed {100 * facts['exposed_host_share']:.0f}% of the step (rank 0, median)")
    else:
        parts.append("host work exposed: --trace-dir measures it")
    return " | ".join(parts)


def run(args: argparse.Namespace) -> int:
    """Fine-tune as the checked flags ``args`` say and print the before/after table (rank 0); returns the exit
    status: 0, 1 for a non-finite loss, 2 for data that cannot be used (before any process starts)."""
    from slidedp_lightning.recipes.data import DataError
    from slidedp_lightning.recipes.own_data import DataFinetuneModule, TokenThroughput, export

    quiet_logs()
    planned = _plan(args)
    L.seed_everything(args.seed, workers=True, verbose=False)
    try:
        module = _module(args)
        strategy = strategy_for(args)  # the strategy checks its options as it is made
    except (DataError, OSError, ValueError) as err:  # before any process is started
        print(f"slidedp-finetune: error: {err}", file=sys.stderr, flush=True)
        return 2
    _log_model_defaults(args)
    _log_precision(args)
    _log_data(args, module)
    max_steps = _max_steps(args, module)

    export_dtype = getattr(torch, args.export_dtype or ("float32" if args.precision == "32-true" else "bfloat16"))
    export_cb = (
        [SaveHuggingFace(args.export, export_dtype, adapter_only=args.export_adapter_only)]
        if args.export and args.strategy == "slidedp"
        else []
    )
    bar = sys.stderr.isatty()
    evals = BeforeAfter(report=not bar)
    throughput, ledger = TokenThroughput(), LedgerFacts()
    memory = PeakHostMemory(launching=_launching_process())
    logger = TensorBoardLogger(save_dir=args.log_dir, name="", default_hp_metric=False)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        **_precision(args),
        max_steps=max_steps,
        accumulate_grad_batches=args.accumulate_grad_batches,
        gradient_clip_val=args.gradient_clip_val,
        logger=logger,
        callbacks=[
            evals,
            LearningRateMonitor(logging_interval="step"),
            throughput,
            ledger,
            memory,
            *([StepBar()] if bar else []),
            *([LaneTrace(args.trace_dir)] if args.trace_dir else []),
            *export_cb,
            *_checkpoints(args, max_steps),
        ],
        use_distributed_sampler=False,  # the modules shard their data in an order a resumed run continues
        enable_checkpointing=args.checkpoint_dir is not None,
        log_every_n_steps=10,
        num_sanity_val_steps=-1,  # the "before" evaluation: the whole validation set, inside the one fit
        check_val_every_n_epoch=None,
        val_check_interval=(args.val_every or max(1, max_steps // 4)) * args.accumulate_grad_batches,  # batches
        enable_progress_bar=bar,
        enable_model_summary=False,  # the table states the parameter count
    )

    if _launching_process():
        write_run_config(args, logger.log_dir)  # before training: a run that dies can still be repeated
    t_fit = time.perf_counter()
    trainer.fit(module, ckpt_path=_resume_from(args))
    fit_s = time.perf_counter() - t_fit
    last = trainer.callback_metrics.get("train_loss")  # last step's, synced across ranks
    train_loss = float(last) if last is not None else float("nan")
    if args.export and isinstance(module, DataFinetuneModule):
        export(trainer, module, args.export, export_dtype, adapter_only=args.export_adapter_only)
    # leave no gloo/NCCL threads to static destructors at interpreter exit (they can abort the process)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()

    before, after = evals.before, evals.after
    if evals.after_step != trainer.global_step:  # the fit ended before its last step was evaluated
        after = _nan_metrics()
    finite = module.nonfinite_loss_steps == 0 and math.isfinite(train_loss) and math.isfinite(after["val_loss"])
    if not trainer.is_global_zero:
        return 0 if finite else 1

    world = trainer.world_size
    tokens_per_s = statistics.median(throughput.rates[1:]) if len(throughput.rates) > 1 else float("nan")
    step_s = statistics.median(throughput.steps[1:]) if len(throughput.steps) > 1 else float("nan")
    saved = [cb.best_model_path for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]  # type: ignore[attr-defined]
    checkpoint = next((path for path in saved if path), None)  # the newest: the callback keeps the largest step
    if args.results:
        report = {"before": before, "after": after, "train_loss": train_loss, "steps": trainer.global_step}
        report |= {"tokens_per_s": tokens_per_s, "step_s": step_s, **ledger.facts, "checkpoint": checkpoint}
        report |= {"peak_host_bytes": memory.peak_bytes, "peak_host_processes": memory.processes}
        report |= {"export": os.path.abspath(args.export) if args.export else None}
        if isinstance(module, DataFinetuneModule):
            report |= module.packing_facts()
        report["plan"] = planned
        with open(args.results, "w") as f:
            json.dump(report, f)
    params = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
    task = f"{TASK.task} {TASK.length} symbols of {TASK.num_symbols}" if args.data is None else args.data
    lines = [
        "",
        f"task: {task} | model: {args.model or DEFAULT_CONFIG} ({params:,} params) | "
        f"strategy: {args.strategy} x{world} | precision: {args.precision} | steps: {trainer.global_step} | "
        f"global batch: {args.batch_size * world}",
        f"{'':8s}{'loss':>9s}{'acc':>8s}{'exact':>8s}",
        *(
            f"{name:8s}{m['val_loss']:9.4f}{m['val_acc']:8.3f}{m['val_exact']:8.3f}"
            for name, m in (("before", before), ("after", after))
        ),
        f"last train_loss {train_loss:.4f} | {tokens_per_s:,.0f} tokens/s, {step_s:.3f} s a step (medians) | time: "
        f"eval before {evals.seconds['before']:.1f} s, fit {fit_s:.1f} s (both evals included), eval after "
        f"{evals.seconds['after']:.1f} s",
        _memory_line(memory, ledger.facts),
        f"TensorBoard logs: {logger.log_dir} (its config.yaml repeats this run)",
        *([f"last checkpoint: {checkpoint}"] if checkpoint else []),
        *(
            [f"exported ({args.export_dtype or str(export_dtype).removeprefix('torch.')}): {args.export}"]
            if args.export
            else []
        ),
    ]
    if not finite:
        lines.append(
            f"ERROR: non-finite loss (non-finite training steps on rank 0: {module.nonfinite_loss_steps}, "
            f"last train_loss {train_loss}, val_loss {after['val_loss']})"
        )
    sys.stderr.flush()
    print("\n".join(lines), flush=True)  # the job's result: the user's output, last
    return 0 if finite else 1
