"""Filling one unit's BF16 device buffer on a CPU device, three ways, side by side (medians):

- ``bf16 copy``: the default ledger, a BF16 copy kept: copy 2 B/param;
- ``host convert``: ``bf16_copy=False``: convert the FP32 master into the reused staging buffer, then copy it;
- ``convert in copy``: ``bf16_copy=False, h2d_convert="device"``: one copy that converts (on CUDA: an FP32 copy
  over the link, converted by the device).

Usage: `python experiments/h2d_convert.py [--elems 16777216] [--repeats 15] [--threads N]`
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elems", type=int, default=16 * 2**20)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.elems
    master = torch.randn(n)
    bf16 = master.to(torch.bfloat16)
    staging = torch.empty(n, dtype=torch.bfloat16)
    buf = torch.empty(n, dtype=torch.bfloat16)

    def host_convert() -> None:
        staging.copy_(master)
        buf.copy_(staging)

    ways = {
        "bf16 copy": lambda: buf.copy_(bf16),
        "host convert": host_convert,
        "convert in copy": lambda: buf.copy_(master),
    }
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.repeats):  # interleaved: every way sees the same machine state
        for name, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["bf16 copy"])
    print(
        f"| way | median ms | GB/s of the BF16 buffer | vs bf16 copy |  ({n:,} elements, {torch.get_num_threads()} threads)"
    )
    print("|---|---|---|---|")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m * 1e3:.2f} | {2 * n / m / 1e9:.2f} | {m / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
