"""Parameter and gradient routes (full/sharded x gpu_reduce/host_reduce, and the probed choice).

Usage: `python experiments/table_routes.py [--scale gpu] [--ranks R] [--out DIR] [--quick]`
"""

from __future__ import annotations

import sys

PAPER = """A800, per-GPU batch 16: NVLink bridge -> sharded 17 % faster; no bridge -> full 26 % faster
per-GPU batch 8: bridge -> sharded 33 %; no bridge -> full 19 %"""


def build(results, sc):
    from bench import tables

    return tables.routes(results, sc)


def main(argv: list[str] | None = None) -> int:
    from paper_common import run_table

    return run_table(argv, __doc__, ("variants/", "routes/"), build, PAPER)


if __name__ == "__main__":
    sys.exit(main())
