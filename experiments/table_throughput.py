"""Throughput of SlideDP vs FSDP2, FSDP2+CPU offload, ZeRO-Offload, the replicated mode and DDP at matched batch.

Usage: `python experiments/table_throughput.py [--scale gpu] [--ranks R] [--out DIR] [--quick]`
"""

from __future__ import annotations

import sys

PAPER = """geometric-mean ratio vs SlideFormer / MegaTrain / ZeRO-Offload at matched batch: 1.46x - 2.64x
4x RTX 4090, Qwen3-8B, batch 64: 9810 tokens/s, all baselines out of memory
4x H100, Qwen3-14B, batch 256: 23 200 tokens/s, 11.2 % above FSDP2's measured peak"""


def build(results, sc):
    from bench import tables

    return tables.throughput(results, sc)


def main(argv: list[str] | None = None) -> int:
    from paper_common import run_table

    return run_table(argv, __doc__, ("systems/",), build, PAPER)


if __name__ == "__main__":
    sys.exit(main())
