"""Same-process, interleaved throughput of the CPU update against its alternatives and the bandwidth ceiling.

    python bench/adam_throughput.py [--sizes 16 64] [--repeats 5] [--threads 1]

Prints Gparam/s (median of the repeats, after two warm-up calls) and GB/s at 28 B/param (fp32 AdamW
moves p, g, m, v in and p, m, v out). The "bandwidth ceiling" kernel moves the same bytes with trivial
math. The pytest-benchmark suite (bench/ --benchmark) supersedes this script as it grows.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np
import torch
from numba import njit, prange

from cpu_ops import adamw_update, set_kernel_threads, warmup

PAGE = 4096


@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def _adam_shaped_copy(p, g, m, v):
    for i in prange(p.shape[0]):
        gi = g[i]
        m[i] = m[i] + gi
        v[i] = v[i] + gi
        p[i] = p[i] - gi


def _aligned(n: int, dtype) -> np.ndarray:
    """A page-aligned array, padded by a page so buffers never sit at power-of-two distances."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.empty(n * itemsize + 2 * PAGE, np.uint8)
    start = (-raw.ctypes.data) % PAGE
    return raw[start : start + n * itemsize].view(dtype)


def _median_seconds(fn, repeats: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(n: int, repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    p, m, v = (_aligned(n, np.float32) for _ in range(3))
    g = _aligned(n, np.float32)
    p[:] = rng.standard_normal(n, dtype=np.float32)
    g[:] = rng.standard_normal(n, dtype=np.float32) * 1e-3
    m[:] = 0
    v[:] = 0
    g16 = _aligned(n, np.uint16)
    g16[:] = (g.view(np.uint32) >> 16).astype(np.uint16)
    out16 = _aligned(n, np.uint16)
    hyper = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    tp = torch.from_numpy(p.copy()).requires_grad_()
    tp.grad = torch.from_numpy(g.copy())
    fused = torch.optim.AdamW([tp], fused=True, **{"lr": 1e-4, "weight_decay": 0.01})
    step = [0]

    def ours_fp32():
        step[0] += 1
        adamw_update(p, m, v, g, step=step[0], **hyper)

    def ours_bf16():
        step[0] += 1
        adamw_update(p, m, v, g16, step=step[0], bf16_out=out16, **hyper)

    cases = {
        "bandwidth ceiling (Adam-shaped copy)": lambda: _adam_shaped_copy(p, g, m, v),
        "cpu_ops fp32 grad": ours_fp32,
        "cpu_ops bf16 grad + bf16 copy out": ours_bf16,
        "torch AdamW fused=True (fp32)": fused.step,
    }
    results = {name: [] for name in cases}
    for _ in range(3):  # interleave rounds so drifting memory bandwidth hits every case alike
        for name, fn in cases.items():
            results[name].append(_median_seconds(fn, repeats))
    return {name: n / statistics.median(ts) / 1e9 for name, ts in results.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 64], help="millions of parameters")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    set_kernel_threads(args.threads)
    warmup(sum_rows=(2,))
    rows = {n: run(n * 1_000_000, args.repeats) for n in args.sizes}
    names = list(next(iter(rows.values())))
    head = " | ".join(f"{n}M Gparam/s (GB/s @28 B)" for n in args.sizes)
    print(f"threads={args.threads}, median of {args.repeats} x 3 interleaved rounds\n")
    print(f"| implementation | {head} |")
    print("|---|" + "---|" * len(args.sizes))
    for name in names:
        cells = " | ".join(f"{rows[n][name]:.2f} ({rows[n][name] * 28:.0f})" for n in args.sizes)
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
