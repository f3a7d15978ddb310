"""Ahead-of-use JIT compilation of the kernels, and a vectorization check for debugging."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable
from typing import Any, TypedDict

import numba
import numpy as np
from numba.core.dispatcher import Dispatcher

from cpu_ops import _kernels
from cpu_ops.accumulate import accumulate, sum_squares
from cpu_ops.adamw import _hyperparameters, adamw_update, adamw_update_sum
from cpu_ops.adamw8 import QUANT_BLOCK, adamw8_update, dequantize_blockwise, quantize_blockwise
from cpu_ops.convert import bf16_to_fp32, fp32_to_bf16

__all__ = ["warmup", "is_vectorized"]

log = logging.getLogger(__name__)

_N = 64  # tiny arrays: compile (or load from cache) only
_GRAD_DTYPES = (np.float32, np.uint16)


class _Hyper(TypedDict):
    """The keyword hyperparameters shared by :func:`adamw_update` and :func:`adamw_update_sum`."""

    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


_HYPER: _Hyper = {"step": 1, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
_KERNELS: dict[str, Dispatcher[Any]] = {
    "adamw": _kernels.adamw_kernel,
    "adamw_bf16_out": _kernels.adamw_bf16_out_kernel,
    "fp32_to_bf16": _kernels.fp32_to_bf16_kernel,
    "bf16_to_fp32": _kernels.bf16_to_fp32_kernel,
}
_VECTOR_OPS = re.compile(r"<(?:16|8) x (?:float|i32)>")


def _state() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.ones(_N, np.float32), np.zeros(_N, np.float32), np.zeros(_N, np.float32)


def warmup(sum_rows: Iterable[int] = (2,), adam8: bool = False) -> float:
    """Compile (or load from Numba's cache) every kernel signature the runtime uses.

    Covers fp32 and bf16 grads, with and without ``bf16_out``, the single-grad route,
    the summed route for each R in ``sum_rows`` (pass the local world size), and both
    conversions.  ``adam8=True`` also compiles the 8-bit-moment kernels (:mod:`cpu_ops.adamw8`) for the
    same gradient routes, and block-wise (de)quantization.  Runs on tiny arrays; returns the seconds spent.
    """
    start = time.perf_counter()
    rows = sorted({int(r) for r in sum_rows})
    if any(r < 1 for r in rows):
        raise ValueError(f"sum_rows must be >= 1, got {rows}")
    for dtype in _GRAD_DTYPES:
        for bf16_out in (None, np.zeros(_N, np.uint16)):
            adamw_update(*_state(), np.zeros(_N, dtype), bf16_out=bf16_out, **_HYPER)
            for r in rows:
                adamw_update_sum(*_state(), np.zeros((r, _N), dtype), bf16_out=bf16_out, **_HYPER)
        accumulate(np.zeros(_N, np.float32), np.zeros(_N, dtype), first=True)
        for r in rows:
            accumulate(np.zeros(_N, np.float32), np.zeros((r, _N), dtype))
    if adam8:
        _warmup_adam8(rows)
    sum_squares(np.zeros(_N, np.float32))
    fp32_to_bf16(np.zeros(_N, np.float32), np.zeros(_N, np.uint16))
    bf16_to_fp32(np.zeros(_N, np.uint16), np.zeros(_N, np.float32))
    elapsed = time.perf_counter() - start
    log.info("cpu_ops kernels ready in %.2f s (sum rows %s, 8-bit moments %s)", elapsed, rows, adam8)
    return elapsed


def _warmup_adam8(rows: list[int]) -> None:
    n = 2 * QUANT_BLOCK
    segments = np.array([[0, n, 0]], np.int64)
    hyper = [(_HYPER["lr"], _HYPER["beta1"], _HYPER["beta2"], _HYPER["eps"], _HYPER["weight_decay"], True)]
    for dtype in _GRAD_DTYPES:
        for bf16_out in (None, np.zeros(n, np.uint16)):
            for grad in (np.zeros(n, dtype), *(np.zeros((r, n), dtype) for r in rows)):
                state = (np.ones(n, np.float32), np.zeros(n, np.uint8), np.zeros(n, np.uint8))
                scales = (np.zeros(2, np.float32), np.zeros(2, np.float32))
                adamw8_update(*state, *scales, grad, segments=segments, hyper=hyper, step=1, bf16_out=bf16_out)
    for signed in (True, False):
        dequantize_blockwise(*quantize_blockwise(np.zeros(n, np.float32), signed), signed)


def _example_args(kernel_name: str) -> list[tuple]:
    """Representative arguments: single fp32 grad, and bf16 grads summed over 2 rows."""
    if kernel_name == "fp32_to_bf16":
        return [(np.zeros(_N, np.float32), np.zeros(_N, np.uint16))]
    if kernel_name == "bf16_to_fp32":
        return [(np.zeros(_N, np.uint16), np.zeros(_N, np.float32))]
    hyper = _hyperparameters(decoupled=True, grad_scale=1.0, **_HYPER)
    out = (np.zeros(_N, np.uint16),) if kernel_name == "adamw_bf16_out" else ()
    grads = [(np.zeros(_N, np.float32),), tuple(np.zeros((2, _N), np.uint16))]
    return [(*_state(), g, *out, *hyper) for g in grads]


def is_vectorized(kernel_name: str) -> bool:
    """True if the kernel's LLVM IR has ``<16 x float>`` or ``<8 x float>`` vector ops.

    The bf16 -> fp32 conversion is pure bit shuffling, so ``<16 x i32>``/``<8 x i32>``
    also count.  ``kernel_name``: one of ``adamw``, ``adamw_bf16_out``, ``fp32_to_bf16``,
    ``bf16_to_fp32``.  Numba keeps no IR for cache-loaded code, so this compiles a
    fresh, uncached copy for representative signatures (about a second each).
    """
    try:
        kernel = _KERNELS[kernel_name]
    except KeyError:
        raise ValueError(f"unknown kernel {kernel_name!r}; choose from {sorted(_KERNELS)}") from None
    options = {k: v for k, v in kernel.targetoptions.items() if k != "nopython"}
    fresh = numba.njit(**options)(kernel.py_func)
    for args in _example_args(kernel_name):
        fresh.compile(tuple(numba.typeof(a) for a in args))
    irs = fresh.inspect_llvm()
    return bool(irs) and all(_VECTOR_OPS.search(ir) for ir in irs.values())
