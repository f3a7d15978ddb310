"""AutoPolicy on/off (SlideDP; off = full-layer checkpointing).

Usage: `python experiments/table_autopolicy.py [--scale gpu] [--ranks R] [--out DIR] [--quick]`
"""

from __future__ import annotations

import sys

PAPER = """4x H100, Qwen3-14B, batch 32: 17 370 -> 19 530 tokens/s (+12.4 %), host memory 261.9 -> 200.6 GB (-23.4 %)
search 1218 s, saves 0.97 s per step, pays back after 1257 steps"""


def build(results, sc):
    from bench import tables

    return tables.autopolicy(results, sc)


def main(argv: list[str] | None = None) -> int:
    from paper_common import run_table

    return run_table(argv, __doc__, ("autopolicy/",), build, PAPER)


if __name__ == "__main__":
    sys.exit(main())
