"""Gradient accumulation in host memory and its squared norm (deferred updates: clipping, skipped steps)."""

from __future__ import annotations

import numpy as np

from cpu_ops import _kernels
from cpu_ops._validate import check_vector
from cpu_ops.adamw import _GRAD_DTYPES, grad_rows

__all__ = ["accumulate", "sum_squares"]


def accumulate(acc: np.ndarray, grads: np.ndarray, *, grad_scale: float = 1.0, first: bool = False) -> None:
    """``acc (+)= sum_r(grads[r] * grad_scale)``: ``grads`` 1-D (one gradient) or 2-D (R rows, host reduce),
    float32 or uint16 (bf16 bits); ``first`` overwrites instead of adding. The same float32 arithmetic as the
    update's own gradient sum."""
    n = check_vector("acc", acc, None, (np.dtype(np.float32),), writeable=True).shape[0]
    if grads.ndim == 1:
        check_vector("grads", grads, n, _GRAD_DTYPES)
        rows = (grads,)
    else:
        rows = grad_rows(grads, n)
    _kernels.accumulate_kernel(acc, rows, np.float32(grad_scale), bool(first))


def sum_squares(x: np.ndarray) -> float:
    """The sum of squares of a float32 vector, accumulated in float64."""
    check_vector("x", x, None, (np.dtype(np.float32),))
    return float(_kernels.sum_squares_kernel(x))
