"""AdamW with 8-bit moments: block-wise dynamic quantization (Dettmers et al., "8-bit Optimizers via
Block-wise Quantization", 2021, arXiv 2110.02861), fused into one Numba pass per block.

Scheme:

* ``exp_avg`` uses the *signed dynamic tree* map: after the sign bit, the number of leading zero bits
  ``e`` (0..6) is a decimal exponent, the first one bit is an indicator and the remaining ``6 - e`` bits
  are a linear fraction in (0.1, 1]: ``value = ±10**-e * (0.1 + 0.9 * (k + 1) / 2**(6 - e))``.  That is
  127 magnitudes from 1e-6 to 1 per sign, plus 0; the pattern that would be -0 encodes +1e-7 (the next
  exponent) so that the 256 values are distinct.
* ``exp_avg_sq`` (never negative) uses the *unsigned dynamic* map: no sign bit, the fraction gets that bit
  instead (``7 - e`` bits for e = 0..6, and 1e-7 for e = 7), plus 0.
* Both maps contain -1 (signed), 0 and 1 exactly, so a block's absmax element and zeros are exact.
* The zero guard (our addition to the paper's scheme): a positive ``exp_avg_sq`` is stored as at least the
  unsigned map's smallest non-zero code (1e-7 of its block's absmax), never as 0. Nearest rounding would store
  every value below 5e-8 of the block's absmax as 0, and an element whose gradient then stays small (a rarely
  used embedding row beside frequent ones) would step by ``lr * exp_avg / eps`` with an ``exp_avg`` that itself
  sits at its block's smallest code: steps hundreds of times FP32 Adam's. Rounded up, the denominator can only
  grow, so such a step can only be smaller than FP32 Adam's.
* Each block of :data:`QUANT_BLOCK` elements has one float32 absmax per moment; a value is stored as the
  code nearest to ``x / absmax`` (ties to the lower code) and read back as ``code[q] * absmax``.
  :func:`quantize_blockwise` finds that code exactly; the fused update finds it without a table (so that its
  loop vectorizes), which can take the other neighbour where ``x / absmax`` lies within a few float32 ulps of
  the midpoint of two codes (see :mod:`cpu_ops._kernels8`).

Block size: the paper quantizes in blocks of 2048 and shows that block-wise quantization with that size
matches 32-bit Adam, because a block's absmax confines an outlier's precision loss to its own block.  The
ledger's shards start on 1024-element boundaries, so the block must divide 1024; we take 1024, the divisor
closest to the paper's validated setting (half its span, so each element's error bound, which scales with its
own block's absmax, is at least as tight).  Its scales cost 8 bytes per 1024 parameters, and the per-block
work of the fused kernel (segment lookup, loop set-up) is spread over 4x more elements than with 256-element
blocks, which took 13 % less time (docs/PERFORMANCE.md).

The update of an element is exactly the FP32 kernel's (:func:`cpu_ops.adamw_update`): dequantize m and v,
then the same float32 operations, then requantize.  A NaN moment makes its block's absmax NaN, so the whole
block reads back as NaN on the next step.  See docs/PERFORMANCE.md for its speed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np

from cpu_ops import _kernels8
from cpu_ops._kernels8 import S_CODE, U_CODE
from cpu_ops._validate import BF16_BITS, FP32, check_array, check_vector
from cpu_ops.adamw import _GRAD_DTYPES, _hyperparameters, grad_rows

__all__ = [
    "QUANT_BLOCK",
    "adamw8_update",
    "dequantize_blockwise",
    "quantize_blockwise",
    "signed_map",
    "unsigned_map",
]

QUANT_BLOCK: int = 1024
CODES = np.dtype(np.uint8)
_CHUNKS_PER_THREAD = 4


def signed_map() -> np.ndarray:
    """The signed dynamic tree map of ``exp_avg``: 256 sorted float32 values in [-1, 1], with 0."""
    return S_CODE.copy()


def unsigned_map() -> np.ndarray:
    """The unsigned dynamic map of ``exp_avg_sq``: 256 sorted float32 values in [0, 1]."""
    return U_CODE.copy()


def _check_signed(signed: object) -> bool:
    if not isinstance(signed, bool):
        raise TypeError(f"signed must be a bool, got {type(signed).__name__}")
    return signed


def num_blocks(n: int) -> int:
    """Number of absmax scales of an n-element array: ceil(n / QUANT_BLOCK)."""
    return -(-n // QUANT_BLOCK)


def _chunks(nblocks: int) -> int:
    return max(1, min(nblocks, numba.get_num_threads() * _CHUNKS_PER_THREAD))


def quantize_blockwise(x: np.ndarray, signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """Codes (uint8, n) and per-block absmax (float32, ceil(n / QUANT_BLOCK)) of a float32 vector.

    ``signed=True`` is the ``exp_avg`` map, ``False`` the ``exp_avg_sq`` map (x must then be >= 0).
    """
    _check_signed(signed)
    check_vector("x", x, None, (FP32,))
    n = x.shape[0]
    if not signed and n and float(np.min(x)) < 0.0:
        raise ValueError("x has negative values; the unsigned map (signed=False) is for exp_avg_sq only")
    q = np.empty(n, CODES)
    absmax = np.empty(num_blocks(n), np.float32)
    if n:
        _kernels8.quantize_kernel(x, q, absmax, QUANT_BLOCK, _chunks(absmax.shape[0]), signed, False)
    return q, absmax


def dequantize_blockwise(q: np.ndarray, absmax: np.ndarray, signed: bool) -> np.ndarray:
    """float32 ``code[q[i]] * absmax[i // QUANT_BLOCK]`` (the inverse of :func:`quantize_blockwise`)."""
    _check_signed(signed)
    check_vector("q", q, None, (CODES,))
    check_vector("absmax", absmax, num_blocks(q.shape[0]), (FP32,))
    out = np.empty(q.shape[0], np.float32)
    if q.shape[0]:
        _kernels8.dequantize_kernel(q, absmax, out, QUANT_BLOCK, signed)
    return out


def _check_segments(segments: object, n: int, groups: int) -> np.ndarray:
    seg = check_array("segments", segments, (np.dtype(np.int64),), ndim=2)
    if seg.shape[1] != 3:
        raise ValueError(f"segments must have shape (S, 3) of [start, stop, group], got {seg.shape}")
    seg = np.ascontiguousarray(seg)
    if seg.shape[0] == 0:
        return seg
    start, stop, group = seg[:, 0], seg[:, 1], seg[:, 2]
    bad = np.flatnonzero((start < 0) | (stop < start) | (stop > n))
    if bad.size:
        k = int(bad[0])
        raise ValueError(f"segment {k} = [{start[k]}, {stop[k]}) is out of bounds for arrays of length {n}")
    bad = np.flatnonzero(start[1:] < stop[:-1])
    if bad.size:
        k = int(bad[0]) + 1
        raise ValueError(
            f"segments must be sorted and non-overlapping: segment {k} starts at {start[k]} "
            f"before segment {k - 1} stops at {stop[k - 1]}"
        )
    bad = np.flatnonzero((group < 0) | (group >= groups))
    if bad.size:
        k = int(bad[0])
        raise ValueError(f"segment {k} names group {group[k]}, but hyper has {groups} group(s)")
    return seg


def _group_scalars(hyper: Sequence[Sequence], step: int, grad_scale: float) -> tuple[np.float32, np.ndarray]:
    """(grad_scale, (G, 11) float32 rows of :func:`_hyperparameters` minus grad_scale, flags as 0/1)."""
    if isinstance(hyper, (str, bytes)) or not isinstance(hyper, Sequence):
        raise TypeError("hyper must be a sequence of (lr, beta1, beta2, eps, weight_decay, decoupled) per group")
    rows = np.empty((len(hyper), 11), np.float32)
    # validates grad_scale (and step) even when no group is given (every element frozen)
    scale = _hyperparameters(step, 0.0, 0.0, 0.0, 0.0, 0.0, True, grad_scale)[0]
    for g, h in enumerate(hyper):
        if isinstance(h, (str, bytes)) or not isinstance(h, Sequence) or len(h) != 6:
            raise TypeError(f"hyper[{g}] must be a tuple (lr, beta1, beta2, eps, weight_decay, decoupled), got {h!r}")
        lr, beta1, beta2, eps, weight_decay, decoupled = h
        if not isinstance(decoupled, (bool, np.bool_)):
            raise TypeError(f"hyper[{g}]: decoupled must be a bool, got {type(decoupled).__name__}")
        scalars = _hyperparameters(step, lr, beta1, beta2, eps, weight_decay, bool(decoupled), grad_scale)
        scale = scalars[0]
        rows[g] = [np.float32(x) for x in scalars[1:]]
    return scale, rows


def adamw8_update(
    param: np.ndarray,
    exp_avg_q: np.ndarray,
    exp_avg_sq_q: np.ndarray,
    exp_avg_absmax: np.ndarray,
    exp_avg_sq_absmax: np.ndarray,
    grad: np.ndarray,
    *,
    segments: np.ndarray,
    hyper: Sequence[Sequence],
    step: int,
    grad_scale: float = 1.0,
    bf16_out: np.ndarray | None = None,
) -> None:
    """In-place fused AdamW step with block-wise 8-bit moments, per parameter group.

    ``param`` float32 (n,); ``exp_avg_q`` / ``exp_avg_sq_q`` uint8 codes (n,); ``exp_avg_absmax`` /
    ``exp_avg_sq_absmax`` float32 (ceil(n / QUANT_BLOCK),).  Element 0 must be a block start (views of the
    ledger start on block boundaries); only the last block may be short.  ``grad``: float32 or uint16 (bf16
    bits), (n,) or (R, n) rows summed in row order after ``* grad_scale`` (as :func:`cpu_ops.adamw_update_sum`).
    ``segments``: int64 (S, 3) of sorted, non-overlapping ``[start, stop, group]`` ranges; ``hyper[group]`` =
    ``(lr, beta1, beta2, eps, weight_decay, decoupled)``.  Elements in a segment get their group's AdamW step
    (and their bf16 bits in ``bf16_out``); the others keep param and ``bf16_out``, and their moments are only
    requantized with the block's new absmax.
    """
    check_vector("param", param, None, (FP32,), writeable=True)
    n = param.shape[0]
    nblocks = num_blocks(n)
    check_vector("exp_avg_q", exp_avg_q, n, (CODES,), writeable=True)
    check_vector("exp_avg_sq_q", exp_avg_sq_q, n, (CODES,), writeable=True)
    for name, a in (("exp_avg_absmax", exp_avg_absmax), ("exp_avg_sq_absmax", exp_avg_sq_absmax)):
        check_array(name, a, (FP32,), writeable=True)
        if a.shape[0] != nblocks:
            raise ValueError(
                f"{name} has length {a.shape[0]}, expected ceil({n} / {QUANT_BLOCK}) = {nblocks} "
                "(one scale per block of QUANT_BLOCK elements)"
            )
        check_vector(name, a, nblocks, (FP32,), writeable=True)
    if isinstance(grad, np.ndarray) and grad.ndim == 1:
        check_vector("grad", grad, n, _GRAD_DTYPES)
        rows = (grad,)
    else:
        rows = grad_rows(grad, n)
    if bf16_out is not None:
        check_vector("bf16_out", bf16_out, n, (BF16_BITS,), writeable=True)
    scale, scalars = _group_scalars(hyper, step, grad_scale)
    seg = _check_segments(segments, n, scalars.shape[0])
    if n == 0:
        return
    _kernels8.adamw8_kernel(
        param,
        exp_avg_q,
        exp_avg_sq_q,
        exp_avg_absmax,
        exp_avg_sq_absmax,
        rows,
        bf16_out,
        seg,
        scalars,
        scale,
        QUANT_BLOCK,
        _chunks(nblocks),
    )
