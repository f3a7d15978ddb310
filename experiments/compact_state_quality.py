"""Compact host state vs exact AdamW, side by side on the same jobs: loss curves and final quality.

Runs the fine-tuning recipe's model and synthetic data (2 CPU ranks, bf16-mixed) once per host-state mode
and task, with the same seed, data order and schedule:

* ``exact``: ``optimizer_state="fp32"`` (the default, exact AdamW);
* ``int8``: ``optimizer_state="int8"`` (8-bit block-wise moments);
* ``int8-nocopy``: ``optimizer_state="int8", bf16_copy=False``.

Tasks: the main job's ``reverse`` (12 of 60 symbols) and a harder ``sort`` (24 of 60 symbols).

    python experiments/compact_state_quality.py --steps 600 --out /tmp/compact   # all runs, table, plot
    python experiments/compact_state_quality.py --tasks sort --modes exact int8 --seeds 1234 1 2  # seed spread
    python experiments/compact_state_quality.py run --mode int8 --task sort ...   # one run (re-run per rank)

The driver prints a markdown table (final val loss and answer accuracy, relative to ``exact``) and writes
``compact_state_quality.png`` (train loss curves, validation points) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any

MODES: dict[str, dict[str, Any]] = {
    "exact": {"optimizer_state": "fp32", "bf16_copy": True},
    "int8": {"optimizer_state": "int8", "bf16_copy": True},
    "int8-nocopy": {"optimizer_state": "int8", "bf16_copy": False},
}
DEFAULT_SEED = 1234
TASKS: dict[str, dict[str, int | str]] = {
    "reverse": {"task": "reverse", "num_symbols": 60, "length": 12},
    "sort": {"task": "sort", "num_symbols": 60, "length": 24},
}


def run_one(args: argparse.Namespace) -> int:
    """One 2-rank training job; rank 0 writes its curves and final metrics to ``args.results``."""
    import lightning.pytorch as L
    import torch
    from lightning.pytorch.callbacks import Callback

    from slidedp_lightning import SlideDPStrategy
    from slidedp_lightning.recipes.finetune import FinetuneModule

    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")

    class Curves(Callback):
        def __init__(self) -> None:
            self.train: list[tuple[int, float]] = []
            self.val: list[tuple[int, float, float]] = []
            self.bytes_per_param = float("nan")

        def on_train_start(self, trainer, pl_module) -> None:
            self.bytes_per_param = trainer.strategy.engine.ledger_stats().bytes_per_param

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            value = loss.detach().float()
            torch.distributed.all_reduce(value)
            self.train.append((trainer.global_step, float(value) / trainer.world_size))

        def on_validation_end(self, trainer, pl_module) -> None:
            m = trainer.callback_metrics
            if "val_loss" in m and not trainer.sanity_checking:
                self.val.append((trainer.global_step, float(m["val_loss"]), float(m["val_acc"])))

    L.seed_everything(args.seed, workers=True, verbose=False)
    module = FinetuneModule(**TASKS[args.task], lr=args.lr, seed=args.seed)
    curves = Curves()
    trainer = L.Trainer(
        strategy=SlideDPStrategy(**MODES[args.mode]),
        accelerator="cpu",
        devices=2,
        precision="bf16-mixed",
        max_steps=args.steps,
        logger=False,
        callbacks=[curves],
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=None,
        val_check_interval=max(1, args.steps // 6),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    t0 = time.perf_counter()
    trainer.fit(module)
    fit_s = time.perf_counter() - t0
    final = trainer.validate(module, verbose=False)[0]
    if trainer.is_global_zero:
        with open(args.results, "w") as f:
            json.dump(
                {
                    "mode": args.mode,
                    "task": args.task,
                    "steps": trainer.global_step,
                    "fit_s": fit_s,
                    "val_loss": float(final["val_loss"]),
                    "val_acc": float(final["val_acc"]),
                    "train": curves.train,
                    "val": curves.val,
                    "ledger_bytes_per_param": curves.bytes_per_param,
                },
                f,
            )
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def _result_path(out: str, task: str, mode: str, seed: int) -> str:
    return os.path.join(out, f"{task}-{mode}.json" if seed == DEFAULT_SEED else f"{task}-{mode}-seed{seed}.json")


def drive(args: argparse.Namespace) -> int:
    """Every (task, mode, seed) job in a subprocess, then the table and the plot."""
    os.makedirs(args.out, exist_ok=True)
    results: dict[tuple[str, str, int], dict[str, Any]] = {}
    for seed in args.seeds:
        for task in args.tasks:
            for mode in args.modes:
                path = _result_path(args.out, task, mode, seed)
                if args.reuse and os.path.exists(path):
                    with open(path) as f:
                        results[task, mode, seed] = json.load(f)
                    continue
                cmd = [sys.executable, os.path.abspath(__file__), "run", "--mode", mode, "--task", task]
                cmd += ["--steps", str(args.steps), "--lr", str(args.lr), "--seed", str(seed), "--results", path]
                print(f"[{time.strftime('%H:%M:%S')}] {task} / {mode} / seed {seed}", flush=True)
                with open(path[: -len(".json")] + ".log", "w") as log:
                    code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
                if code != 0:
                    print(f"{task} / {mode} / seed {seed} failed (exit {code}); see {log.name}", file=sys.stderr)
                    return 1
                with open(path) as f:
                    results[task, mode, seed] = json.load(f)
    _table(results, args)
    _plot(results, args)
    return 0


def _table(results: dict[tuple[str, str, int], dict[str, Any]], args: argparse.Namespace) -> None:
    """Per seed: each mode against exact AdamW of the same seed; then the means over the seeds."""
    print()
    print(
        "| task | mode | seed | ledger B/param | final val loss | vs exact | answer accuracy | vs exact (points) | fit |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for task in args.tasks:
        for mode in args.modes:
            for seed in args.seeds:
                r, ref = results[task, mode, seed], results[task, "exact", seed]
                rel = (r["val_loss"] / ref["val_loss"] - 1) * 100
                pts = (r["val_acc"] - ref["val_acc"]) * 100
                print(
                    f"| {task} | {mode} | {seed} | {r['ledger_bytes_per_param']:.2f} | {r['val_loss']:.3g} | "
                    f"{rel:+.2f} % | {r['val_acc']:.4f} | {pts:+.2f} | {r['fit_s']:.0f} s |"
                )
    if len(args.seeds) < 2:
        return
    print(f"\nmeans over seeds {', '.join(map(str, args.seeds))}:\n")
    print(
        "| task | mode | mean val loss | vs exact | spread over seeds (max/min - 1) | mean accuracy | vs exact (points) |"
    )
    print("|---|---|---|---|---|---|---|")
    for task in args.tasks:
        ref_loss = statistics.fmean(results[task, "exact", s]["val_loss"] for s in args.seeds)
        ref_acc = statistics.fmean(results[task, "exact", s]["val_acc"] for s in args.seeds)
        for mode in args.modes:
            losses = [results[task, mode, s]["val_loss"] for s in args.seeds]
            acc = statistics.fmean(results[task, mode, s]["val_acc"] for s in args.seeds)
            loss = statistics.fmean(losses)
            print(
                f"| {task} | {mode} | {loss:.3g} | {(loss / ref_loss - 1) * 100:+.2f} % | "
                f"{(max(losses) / min(losses) - 1) * 100:.1f} % | {acc:.4f} | {(acc - ref_acc) * 100:+.2f} |"
            )


def _plot(results: dict[tuple[str, str, int], dict[str, Any]], args: argparse.Namespace) -> None:
    """Loss curves of the first seed, every mode, one panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.tasks), figsize=(6 * len(args.tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], args.tasks):
        for mode in args.modes:
            r = results[task, mode, args.seeds[0]]
            steps, losses = zip(*r["train"])
            (line,) = ax.plot(steps, losses, lw=0.8, alpha=0.8, label=f"{mode} (train)")
            if r["val"]:
                vs, vl, _ = zip(*r["val"])
                ax.plot(vs, vl, "o--", color=line.get_color(), ms=4, label=f"{mode} (val)")
        spec = TASKS[task]
        ax.set_title(
            f"{spec['task']} {spec['length']} of {spec['num_symbols']} symbols, 2 ranks, bf16-mixed, seed {args.seeds[0]}"
        )
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss (answer tokens)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(args.out, "compact_state_quality.png")
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", default="drive", choices=("drive", "run"))
    p.add_argument("--mode", choices=tuple(MODES), default="exact")
    p.add_argument("--task", choices=tuple(TASKS), default="reverse")
    p.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    p.add_argument("--tasks", nargs="+", choices=tuple(TASKS), default=list(TASKS))
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="the seed of one run")
    p.add_argument(
        "--seeds", nargs="+", type=int, default=[DEFAULT_SEED], help="the driver's seeds, every job per seed"
    )
    p.add_argument("--results", default="results.json")
    p.add_argument("--out", default="runs/compact_state_quality")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--reuse", action="store_true", help="keep the results already in --out, run only the missing")
    args = p.parse_args()
    if args.command == "run":
        return run_one(args)
    if "exact" not in args.modes:
        p.error("--modes must include exact: every compact mode is compared with it")
    return drive(args)


if __name__ == "__main__":
    raise SystemExit(main())
