"""Scaling with rank count: fixed global batch (strong) and fixed per-rank batch (weak), SlideDP vs replicated.

Usage: `python experiments/table_scaling.py [--scale gpu] [--ranks R] [--out DIR] [--quick]`
"""

from __future__ import annotations

import sys

PAPER = """replicated (SlideFormer-style) baseline, 8x A800, Qwen3-14B, fixed global batch: 4 -> 8 GPUs, step time flat at ~43 s
one GPU copying a layer host->device: 15.6 GB/s; two at once: 8.7 GB/s each"""


def build(results, sc):
    from bench import tables

    return tables.scaling(results, sc)


def main(argv: list[str] | None = None) -> int:
    from paper_common import run_table

    return run_table(argv, __doc__, ("variants/", "scaling/"), build, PAPER)


if __name__ == "__main__":
    sys.exit(main())
