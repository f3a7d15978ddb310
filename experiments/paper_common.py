"""Shared by the ``experiments/table_*.py`` scripts: arguments, running the jobs a table needs, printing.

Each script reproduces one table of the paper (arXiv 2609.34162, §4) on a multi-GPU host with the ``--scale gpu``
configurations of ``bench/configs.py`` (Qwen3-4B/8B/14B shapes) and prints it next to the paper's numbers.
Results (JSON per run, logs, ``report.md`` with the table, plots) go under ``--out``. The table is printed and
written even when the run is stopped (Ctrl-C, SIGTERM): runs not reached say ``not run``. One-time costs (initial
weights, Numba kernels, DeepSpeed's op build) come first, outside the jobs' timeouts (``bench/prepare.py``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", choices=("gpu", "cpu"), default="gpu", help="configuration set (default: gpu)")
    p.add_argument("--ranks", type=int, default=None, help="ranks (default: every visible CUDA device; cpu: 2)")
    p.add_argument("--out", type=Path, default=None, help="results directory (default results/experiments-<time>)")
    p.add_argument(
        "--quick", action="store_true", help="the scale's quick subset (pytest bench/ --benchmark --bench-quick)"
    )
    return p


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def run_table(argv: list[str] | None, doc: str, prefixes: tuple[str, ...], build: Callable, paper: str) -> int:
    """Parse ``argv``, run every job with a run named by one of ``prefixes``, print ``build(results, scale)``'s
    tables and the paper's numbers (also after an interrupt, with what ran); returns the exit status."""
    args = parser(doc).parse_args(argv)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import torch

    from bench.configs import plan, scale
    from bench.prepare import WeightsCounter, prepare
    from bench.report import BenchReport
    from bench.suite import Suite

    ranks = args.ranks or (torch.cuda.device_count() if args.scale == "gpu" else None)
    if args.scale == "gpu" and not torch.cuda.is_available():
        print("--scale gpu needs CUDA devices; none is visible", file=sys.stderr)
        return 2
    sc = scale(args.scale, ranks, fast=args.quick)
    out = args.out or REPO / "results" / time.strftime("experiments-%Y%m%d-%H%M%S", time.gmtime())
    report = BenchReport(out)
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    status = 0
    try:
        print("one-time: initial weights ...", flush=True)
        jobs = plan(sc, out / "init", init=WeightsCounter())
        wanted = [j for j in jobs if any(r.name.startswith(prefixes) for r in j.runs)]
        uses_deepspeed = any(r.spec.system == "zero_offload" for j in wanted for r in j.runs)
        progress = lambda msg: print(msg, flush=True)  # noqa: E731
        prep = prepare(sc.accelerator, sc.ranks, out, progress, needs_deepspeed=uses_deepspeed)
        suite = Suite(sc, jobs, report, selected=[], progress=progress, blocked=prep.blocked)
        try:
            suite.need(*prefixes)
        except KeyboardInterrupt:
            print("interrupted: the table below has what ran", file=sys.stderr)
            status = 130
        for table in build(suite.final_runs(), sc):
            report.table(table)
            print("\n" + table.markdown())
        report.write(final=True)
        print(f"\nresults: {out / 'report.md'}")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    print("\nPaper:\n" + paper)
    return status
