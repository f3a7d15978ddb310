"""How far int8 moments take the weights from the FP32 ledger's: the tiny test model, FP32 compute, one CPU
process, the same 8 batches in both runs; per-element |w_int8 - w_fp32| against the FP32 run's own movement.

Usage: `PYTHONPATH=$PWD python experiments/int8_drift.py [--steps 8]` (from the repository root: it uses tests/)
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    from slidedp_lightning.runtime.engine import EngineConfig
    from tests.helpers import tiny_model
    from tests.runtime.ledger.test_compact_state import run

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    exact = run(EngineConfig(), steps=args.steps)
    got = run(EngineConfig(optimizer_state="int8"), steps=args.steps)
    init = tiny_model(False, layers=3).state_dict()
    off = torch.cat([(got[1][k] - exact[1][k]).reshape(-1) for k in init]).abs()
    moved = torch.cat([(exact[1][k] - init[k]).reshape(-1) for k in init]).abs()
    print("| | median | p90 | max |")
    print("|---|---|---|---|")
    print(f"| FP32 run: movement | {moved.median():.2e} | {moved.quantile(0.9):.2e} | {moved.max():.2e} |")
    print(f"| int8 vs FP32 | {off.median():.2e} | {off.quantile(0.9):.2e} | {off.max():.2e} |")
    for k in init:
        d = (got[1][k] - exact[1][k]).abs()
        if d.max() > 10 * moved.max():
            print(
                f"{k}: {int((d > 10 * moved.max()).sum())} of {d.numel()} elements off by more than 10x the largest move"
            )
    worst = max(abs(a - b) / abs(b) for a, b in zip(got[0], exact[0]))
    print(f"losses: largest relative difference {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
