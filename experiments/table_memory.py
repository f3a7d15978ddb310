"""Peak device and host memory of every system at the same (feasible) batch.

Usage: `python experiments/table_memory.py [--scale gpu] [--ranks R] [--out DIR] [--quick]`
"""

from __future__ import annotations

import sys

PAPER = """peak GPU memory at equal feasible batch: -51 % to -59 % vs ZeRO-Offload, -29 % to -42 % vs MegaTrain
H100, Qwen3-14B, batch 32, fixed configuration: 15 GB of 80 GB"""


def build(results, sc):
    from bench import tables

    return tables.memory(results, sc)


def main(argv: list[str] | None = None) -> int:
    from paper_common import run_table

    return run_table(argv, __doc__, ("systems/",), build, PAPER)


if __name__ == "__main__":
    sys.exit(main())
