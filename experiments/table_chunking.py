"""Gradient-path chunking on/off (SlideDP).

Usage: `python experiments/table_chunking.py [--scale gpu] [--ranks R] [--out DIR] [--quick]`
"""

from __future__ import annotations

import sys

PAPER = """Qwen3-8B, 4 GPUs: 3218 -> 3465 tokens/s (+7.7 %); 1 GPU: +33.6 %
single layer: convert+transfer 127.8 -> 50.8 ms; transfer+update 135.9 -> 91.7 ms"""


def build(results, sc):
    from bench import tables

    return tables.chunking(results, sc)


def main(argv: list[str] | None = None) -> int:
    from paper_common import run_table

    return run_table(argv, __doc__, ("variants/", "chunking/"), build, PAPER)


if __name__ == "__main__":
    sys.exit(main())
