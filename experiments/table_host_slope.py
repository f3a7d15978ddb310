"""Host memory per billion parameters: the slope over three model sizes (Qwen3-4B/8B/14B shapes).

Usage: `python experiments/table_host_slope.py [--scale gpu] [--ranks R] [--out DIR] [--quick]`
"""

from __future__ import annotations

import sys

PAPER = """SlideDP 14.2 GB per billion parameters; the others 19.8 - 22.9 GB
(FP32 master + two FP32 moments = 12 B/param; the BF16 transfer copy adds 2 B/param)"""


def build(results, sc):
    from bench import tables

    return [tables.host_slopes(results, sc).table]


def main(argv: list[str] | None = None) -> int:
    from paper_common import run_table

    return run_table(argv, __doc__, ("systems/",), build, PAPER)


if __name__ == "__main__":
    sys.exit(main())
