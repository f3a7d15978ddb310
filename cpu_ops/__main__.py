"""``python -m cpu_ops``: compile every kernel signature into Numba's cache ahead of the first job (one core,
about a minute with ``--adam8`` on a 2-core machine; later processes load the compiled code in well under a second)."""

from __future__ import annotations

import argparse
import logging

from cpu_ops.warmup import warmup


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cpu_ops", description=__doc__)
    parser.add_argument(
        "--sum-rows", type=int, nargs="+", default=[2], metavar="R", help="gradient rows summed: local ranks [2]"
    )
    parser.add_argument("--adam8", action="store_true", help="also the 8-bit-moment kernels")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    warmup(sum_rows=args.sum_rows, adam8=args.adam8)


if __name__ == "__main__":
    main()
