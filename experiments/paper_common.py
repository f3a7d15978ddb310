"""Shared by the ``experiments/table_*.py`` scripts: arguments, running the jobs a table needs, printing.

Each script reproduces one table of the paper (arXiv 2609.34162, §4) on a multi-GPU host with the ``--scale gpu``
configurations of ``bench/configs.py`` (Qwen3-4B/8B/14B shapes) and prints it next to the paper's numbers.
Results (JSON per run, logs) go under ``--out``.
"""

from __future__ import annotations

import argparse
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
    return p


def run_table(argv: list[str] | None, doc: str, prefixes: tuple[str, ...], build: Callable, paper: str) -> int:
    """Parse ``argv``, run every job with a run named by one of ``prefixes``, print ``build(results, scale)``'s
    tables and the paper's numbers."""
    args = parser(doc).parse_args(argv)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import torch

    from bench.baselines.runner import run_job
    from bench.configs import plan, scale

    ranks = args.ranks or (torch.cuda.device_count() if args.scale == "gpu" else None)
    if args.scale == "gpu" and not torch.cuda.is_available():
        print("--scale gpu needs CUDA devices; none is visible", file=sys.stderr)
        return 2
    sc = scale(args.scale, ranks)
    out = args.out or REPO / "results" / time.strftime("experiments-%Y%m%d-%H%M%S", time.gmtime())
    results = {}
    for job in plan(sc, out / "init"):
        if any(r.name.startswith(prefixes) for r in job.runs):
            for r in run_job([(r.name, r.spec) for r in job.runs], out / "jobs" / job.name):
                results[r.name] = r
                print(f"{r.name}: {r.status} {r.reason}", flush=True)
    for table in build(results, sc):
        print("\n" + table.markdown())
    print("\nPaper:\n" + paper)
    return 0
