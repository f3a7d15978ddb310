"""Fused in-place Adam/AdamW steps on flat numpy arrays (Numba, vectorized, multi-threaded).

Numerics mirror torch's single-tensor CPU Adam (``torch/optim/adam.py``
``_single_tensor_adam``, the ``foreach=False`` default on CPU) operation by operation in
float32, including the fused multiply-adds torch's vectorized CPU kernels use.  On the
AVX-512 machine this was written on, ``exp_avg`` and ``exp_avg_sq`` come out bit-identical
to torch; ``param`` differs by at most 1 ulp on a few elements because torch's ``sqrt``
(MKL VML) is not correctly rounded.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

import numpy as np

from cpu_ops import _kernels
from cpu_ops._validate import BF16_BITS, FP32, check_array, check_vector

__all__ = ["adamw_update", "adamw_update_sum"]

_GRAD_DTYPES = (FP32, BF16_BITS)
_F32 = np.float32


def _check_real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def _hyperparameters(
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    grad_scale: float,
) -> tuple:
    """Validate like torch and return the kernel's scalar arguments (all float32 or bool)."""
    if isinstance(step, bool) or not isinstance(step, Integral):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    if step < 1:
        raise ValueError(f"step must be >= 1 (1-based count of updates including this one), got {step}")
    lr, beta1, beta2, eps, weight_decay, grad_scale = (
        _check_real(name, value)
        for name, value in (
            ("lr", lr),
            ("beta1", beta1),
            ("beta2", beta2),
            ("eps", eps),
            ("weight_decay", weight_decay),
            ("grad_scale", grad_scale),
        )
    )
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr} (need lr >= 0)")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps} (need eps >= 0)")
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"Invalid beta1: {beta1} (need 0 <= beta1 < 1)")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"Invalid beta2: {beta2} (need 0 <= beta2 < 1)")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay} (need weight_decay >= 0)")
    if not math.isfinite(grad_scale):
        raise ValueError(f"grad_scale must be finite, got {grad_scale}")

    # Scalars in Python float64 exactly as torch computes them, then rounded to float32.
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    lerp_weight = _F32(1 - beta1)
    lerp_small = bool(abs(lerp_weight) < 0.5)  # torch's is_lerp_weight_small
    lerp_coeff = lerp_weight if lerp_small else lerp_weight - _F32(1)
    return (
        _F32(grad_scale),
        bool(decoupled and weight_decay != 0),
        _F32(1 - lr * weight_decay),
        bool(not decoupled and weight_decay != 0),
        _F32(weight_decay),
        lerp_small,
        lerp_coeff,
        _F32(beta2),
        _F32(1 - beta2),
        _F32(bias_correction2_sqrt),
        _F32(eps),
        _F32(-step_size),
    )


def _check_state(param: np.ndarray, exp_avg: np.ndarray, exp_avg_sq: np.ndarray) -> int:
    check_vector("param", param, None, (FP32,), writeable=True)
    n = param.shape[0]
    check_vector("exp_avg", exp_avg, n, (FP32,), writeable=True)
    check_vector("exp_avg_sq", exp_avg_sq, n, (FP32,), writeable=True)
    return n


def _run(
    param: np.ndarray,
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    rows: tuple,
    bf16_out: np.ndarray | None,
    hyper: tuple,
) -> None:
    if bf16_out is None:
        _kernels.adamw_kernel(param, exp_avg, exp_avg_sq, rows, *hyper)
    else:
        check_vector("bf16_out", bf16_out, param.shape[0], (BF16_BITS,), writeable=True)
        _kernels.adamw_bf16_out_kernel(param, exp_avg, exp_avg_sq, rows, bf16_out, *hyper)


def adamw_update(
    param: np.ndarray,
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    grad: np.ndarray,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool = True,
    grad_scale: float = 1.0,
    bf16_out: np.ndarray | None = None,
) -> None:
    """In-place fused Adam/AdamW step on 1-D contiguous numpy arrays.

    ``param``, ``exp_avg``, ``exp_avg_sq``: float32, same length n.  ``grad``: float32 or
    uint16 (raw bf16 bits), length n; it is multiplied by ``grad_scale`` first.
    ``bf16_out``: None or a uint16 array of length n that receives the round-to-nearest-even
    bf16 bits of the *new* param, in the same pass.  ``decoupled=True`` is
    ``torch.optim.AdamW``, ``False`` is ``torch.optim.Adam`` (L2 decay added to the grad).
    ``step`` is the 1-based step number of this update (torch's ``state['step']`` after
    its increment).
    """
    hyper = _hyperparameters(step, lr, beta1, beta2, eps, weight_decay, decoupled, grad_scale)
    n = _check_state(param, exp_avg, exp_avg_sq)
    check_vector("grad", grad, n, _GRAD_DTYPES)
    _run(param, exp_avg, exp_avg_sq, (grad,), bf16_out, hyper)


def adamw_update_sum(
    param: np.ndarray,
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    grads: np.ndarray,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool = True,
    grad_scale: float = 1.0,
    bf16_out: np.ndarray | None = None,
) -> None:
    """:func:`adamw_update` with the gradient ``sum_r(grads[r] * grad_scale)`` (host reduce).

    ``grads`` is a 2-D float32 or uint16 (bf16 bits) array of shape (R, n) whose rows are
    contiguous; the row stride may exceed n (a strided view into a bigger buffer).  The sum
    runs in float32 in row order 0..R-1 inside the update pass.  Each distinct R is a
    separate compiled signature (see :func:`cpu_ops.warmup`).
    """
    hyper = _hyperparameters(step, lr, beta1, beta2, eps, weight_decay, decoupled, grad_scale)
    n = _check_state(param, exp_avg, exp_avg_sq)
    _run(param, exp_avg, exp_avg_sq, grad_rows(grads, n), bf16_out, hyper)


def grad_rows(grads: np.ndarray, n: int) -> tuple:
    """Validate an (R, n) gradient-slot array (contiguous rows, any row stride) as a tuple of rows."""
    check_array("grads", grads, _GRAD_DTYPES, ndim=2)
    if grads.shape[0] < 1 or grads.shape[1] != n:
        raise ValueError(f"grads must have shape (R >= 1, {n}), got {grads.shape}")
    if grads.strides[1] != grads.itemsize:
        raise ValueError(
            f"each row of grads must be contiguous (strides {grads.strides}, element stride "
            f"must be {grads.itemsize}); only the row stride may be larger than the row"
        )
    return tuple(grads)
