"""The CPU update against its alternatives and the memory-bandwidth ceiling, measured in one process.

Every implementation runs on the same page-aligned buffers (torch and DeepSpeed optimizers are handed the
same parameter, gradient and moment memory), once per round, in a rotating order, so that drifting memory
bandwidth hits every case alike. One warm-up round, then ``--bench-rounds`` measured rounds; the median
is reported. Bytes/param follow the update's traffic (see ``slidedp_lightning.constants.update_bytes_per_param``).
Needs threadpoolctl (the suite is skipped without it) and, for the DeepSpeedCPUAdam case, DeepSpeed: both are the
``bench`` extra, ``pip install -e ".[bench]"``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from bench.baselines.runner import BENCH_EXTRA
from bench.report import Ratio
from cpu_ops import adam_shaped_copy, adamw_update, adamw_update_sum, physical_cores, set_kernel_threads
from cpu_ops import warmup as kernel_warmup
from slidedp_lightning.constants import update_bytes_per_param as bpp

threadpool_limits = pytest.importorskip(
    "threadpoolctl", reason=f"the CPU update benchmark needs threadpoolctl: {BENCH_EXTRA}"
).threadpool_limits

SUITE = "cpu_adam"
PAGE = 4096
THREADS = sorted({1, physical_cores()})
HYPER = dict(lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def aligned(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Page-aligned array padded by a page, so buffers never sit at power-of-two distances."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + 2 * PAGE, np.uint8)
    start = (-raw.ctypes.data) % PAGE
    return raw[start : start + nbytes].view(dtype).reshape(shape)


class Buffers:
    """Parameters, moments and gradients of one size, as numpy arrays and torch views of the same memory."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(0)
        self.p, self.m, self.v, self.g = (aligned((n,), np.float32) for _ in range(4))
        self.p[:] = rng.standard_normal(n, dtype=np.float32)
        self.g[:] = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
        self.m[:] = 0
        self.v[:] = 0
        self.g16 = aligned((n,), np.uint16)
        self.g16[:] = (self.g.view(np.uint32) >> 16).astype(np.uint16)
        self.out16 = aligned((n,), np.uint16)
        self.rows16 = aligned((4, n), np.uint16)
        self.rows16[:] = self.g16
        self.tp = torch.from_numpy(self.p).requires_grad_()
        self.tp.grad = torch.from_numpy(self.g)
        self.tm, self.tv = torch.from_numpy(self.m), torch.from_numpy(self.v)
        self.tg16 = torch.from_numpy(self.g16.view(np.int16)).view(torch.bfloat16)
        self.tout16 = torch.from_numpy(self.out16.view(np.int16)).view(torch.bfloat16)

    def torch_adamw(self, **kw) -> torch.optim.AdamW:
        """A torch AdamW over the shared parameter whose moments are the shared buffers."""
        opt = torch.optim.AdamW(
            [self.tp],
            lr=HYPER["lr"],
            betas=(HYPER["beta1"], HYPER["beta2"]),
            eps=HYPER["eps"],
            weight_decay=HYPER["weight_decay"],
            **kw,
        )
        opt.state[self.tp] = {"step": torch.tensor(0.0), "exp_avg": self.tm, "exp_avg_sq": self.tv}
        return opt


_DEEPSPEED: dict[str, object] = {}


def deepspeed_adam(blocked: str = "") -> tuple[type | None, str]:
    """DeepSpeedCPUAdam (built once per session, up front: ``bench/prepare.py``), or None and the reason it cannot
    run here (``blocked``: why the up-front build failed)."""
    if "cls" not in _DEEPSPEED and blocked:
        _DEEPSPEED.update(cls=None, why=f"DeepSpeedCPUAdam skipped: {blocked}")
    if "cls" not in _DEEPSPEED:
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            probe = torch.zeros(8, requires_grad=True)
            DeepSpeedCPUAdam([probe])  # JIT-builds the C++ op on first use (about a minute), then cached
            _DEEPSPEED.update(cls=DeepSpeedCPUAdam, why="")
        except ModuleNotFoundError as exc:
            _DEEPSPEED.update(cls=None, why=f"DeepSpeedCPUAdam skipped: {exc} ({BENCH_EXTRA})")
        except Exception as exc:  # no compiler, build failure: say which
            _DEEPSPEED.update(cls=None, why=f"DeepSpeedCPUAdam skipped: {type(exc).__name__}: {exc}".splitlines()[0])
    return _DEEPSPEED["cls"], _DEEPSPEED["why"]


def build_cases(b: Buffers) -> dict[str, tuple[Callable[[], None], int]]:
    """name -> (one call, bytes/param it moves)."""
    step = [0]

    def ours(grad, out=None, rows=False):
        def call() -> None:
            step[0] += 1
            fn = adamw_update_sum if rows else adamw_update
            fn(b.p, b.m, b.v, grad, step=step[0], bf16_out=out, **HYPER)

        return call

    def ceiling(grad, out=None):
        return lambda: adam_shaped_copy(b.p, b.m, b.v, grad, out)

    default, foreach, fused = b.torch_adamw(foreach=False), b.torch_adamw(foreach=True), b.torch_adamw(fused=True)
    job = b.torch_adamw(fused=True)

    def torch_bf16_job() -> None:
        b.tp.grad.copy_(b.tg16)  # cast the bf16 gradient up
        job.step()
        b.tout16.copy_(b.tp.detach())  # cast the new parameter down

    r2, r4 = b.rows16[:2], b.rows16[:4]
    cases = {
        "ceiling fp32 grad": (ceiling(b.g), bpp(4)),
        "cpu_ops fp32 grad": (ours(b.g), bpp(4)),
        "ceiling fp32 grad + bf16 copy": (ceiling(b.g, b.out16), bpp(4, bf16_out=True)),
        "cpu_ops fp32 grad + bf16 copy": (ours(b.g, b.out16), bpp(4, bf16_out=True)),
        "ceiling bf16 grad": (ceiling(b.g16), bpp(2)),
        "cpu_ops bf16 grad": (ours(b.g16), bpp(2)),
        "ceiling bf16 grad + bf16 copy": (ceiling(b.g16, b.out16), bpp(2, bf16_out=True)),
        "cpu_ops bf16 grad + bf16 copy": (ours(b.g16, b.out16), bpp(2, bf16_out=True)),
        "ceiling sum R=2 bf16 + bf16 copy": (ceiling(r2, b.out16), bpp(2, 2, True)),
        "cpu_ops sum R=2 bf16 + bf16 copy": (ours(r2, b.out16, rows=True), bpp(2, 2, True)),
        "ceiling sum R=4 bf16 + bf16 copy": (ceiling(r4, b.out16), bpp(2, 4, True)),
        "cpu_ops sum R=4 bf16 + bf16 copy": (ours(r4, b.out16, rows=True), bpp(2, 4, True)),
        "torch AdamW default (for-loop)": (default.step, bpp(4)),
        "torch AdamW foreach=True": (foreach.step, bpp(4)),
        "torch AdamW fused=True": (fused.step, bpp(4)),
        "torch bf16 job (cast up, fused, cast down)": (torch_bf16_job, bpp(2, bf16_out=True)),
    }
    ds_cls, _ = deepspeed_adam()
    if ds_cls is not None:
        ds = ds_cls(
            [b.tp],
            lr=HYPER["lr"],
            betas=(HYPER["beta1"], HYPER["beta2"]),
            eps=HYPER["eps"],
            weight_decay=HYPER["weight_decay"],
            adamw_mode=True,
        )
        ds.state[b.tp] = {"step": 0, "exp_avg": b.tm, "exp_avg_sq": b.tv}
        cases["DeepSpeedCPUAdam fp32"] = (ds.step, bpp(4))
    return cases


ALL = max(THREADS)
RATIOS = [
    # (label, numerator case, denominator case, target, sizes where it applies (None: all), threads (None: all))
    (
        "bf16 grad + bf16 copy / its ceiling",
        "cpu_ops bf16 grad + bf16 copy",
        "ceiling bf16 grad + bf16 copy",
        0.95,
        (64, 256),
        None,
    ),
    (
        "bf16 grad + bf16 copy / torch doing the same job",
        "cpu_ops bf16 grad + bf16 copy",
        "torch bf16 job (cast up, fused, cast down)",
        1.5,
        None,
        None,
    ),
    ("fp32 / its ceiling", "cpu_ops fp32 grad", "ceiling fp32 grad", 0.95, None, None),
    ("fp32 / torch AdamW fused", "cpu_ops fp32 grad", "torch AdamW fused=True", 1.0, (16, 64, 256), (ALL,)),
    ("fp32 / DeepSpeedCPUAdam", "cpu_ops fp32 grad", "DeepSpeedCPUAdam fp32", 1.0, (16, 64, 256), (ALL,)),
    ("sum R=2 / its ceiling", "cpu_ops sum R=2 bf16 + bf16 copy", "ceiling sum R=2 bf16 + bf16 copy", 0.9, None, None),
    ("sum R=4 / its ceiling", "cpu_ops sum R=4 bf16 + bf16 copy", "ceiling sum R=4 bf16 + bf16 copy", 0.9, None, None),
]


@pytest.mark.parametrize("threads", THREADS, ids=lambda t: f"{t}T")
def test_cpu_adam(benchmark, bench_report, bench_rounds, bench_prepared, bench_check, size_m, threads):
    n = size_m * 1_000_000
    _, ds_why = deepspeed_adam(bench_prepared.blocked.get("zero_offload", ""))
    if ds_why:
        print(ds_why)
        bench_report.note(SUITE, ds_why)
    bench_report.note(
        SUITE,
        "GB/s = Gparam/s x the case's bytes/param (reads + writes; write-allocate not counted); "
        "fp32 AdamW moves 28 B/param",
    )
    with threadpool_limits(limits=threads):
        torch.set_num_threads(threads)
        set_kernel_threads(threads)
        kernel_warmup(sum_rows=(2, 4))
        buffers = Buffers(n)
        cases = build_cases(buffers)
        benchmark.group = f"cpu_adam {size_m}M x{threads}T"
        medians = bench_report.interleaved_medians(benchmark, SUITE, size_m, threads, cases, bench_rounds)
    checked = []
    for label, num, den, target, sizes, thread_counts in RATIOS:
        if num in medians and den in medians:
            applies = (sizes is None or size_m in sizes) and (thread_counts is None or threads in thread_counts)
            # throughput ratio = time ratio inverted
            ratio = Ratio(SUITE, label, size_m, threads, medians[den] / medians[num], target if applies else 0.0)
            bench_report.ratio(ratio)
            if ratio.applies:
                checked.append(ratio.verdict())
    benchmark.extra_info.update({name: n / t / 1e9 for name, t in medians.items()})
    del buffers, cases
    bench_check(checked, record=False)  # verdicts in report.md; a failure only with --bench-strict
