"""AdamW with 8-bit moments: block-wise square-root int8 (``exp_avg``) and FP8 E4M3 (``exp_avg_sq``) codes, one fused
Numba pass.

Format (:data:`MOMENT_FORMAT` ``"sqrt8-e4m3"``): per block of :data:`QUANT_BLOCK` elements and per moment, one uint8
code per element and one float32 scale, the block's absmax (regions ``exp_avg_absmax``, ``exp_avg_sq_absmax``):

* ``exp_avg``: signed int8 of the square root (two's complement, -127..127):
  ``code = sign(m) * round(sqrt(|m| * float32(127**2 / scale)))``, ties to even; read back as
  ``((code * |code|) * float32(1 / 127**2)) * scale`` (exact at +-127, so the absmax element reads back exactly).
  A value is at most 126.75 / 127**2 (0.79 %) of the absmax off; the smallest non-zero value is 1 / 127**2 of it
  (about 2**-14; values under a quarter of it round to 0), where a linear int8 code's is 1 / 127 (values under
  1 / 254 of the absmax round to 0).
* ``exp_avg_sq``: FP8 E4M3 (OCP: 4 exponent bits, 3 mantissa bits, subnormals; "FP8 Formats for Deep Learning",
  arXiv 2209.05433) of ``v * (1 / scale) * 2**8``: the absmax maps to E4M3 256 (codes up to 0x78; the values above
  it are unused), nearest, ties away from zero; read back as ``e4m3(code) * (scale * 2**-8)``. 1/16 relative error
  over 14 binades below the absmax, then subnormals down to 2**-17 of it. Where the float16 of ``v / scale`` is
  subnormal (under 2**-14 of the absmax), the kernel rounds twice (float16, then E4M3): one code off at most.
* The zero guard: a positive ``exp_avg_sq`` is never stored as 0 (at least the smallest code), 0 is stored as 0.
  A second moment read back as 0 would make the next step ``lr * exp_avg / eps``, hundreds of times FP32 Adam's
  (the zero-point problem of Li et al., "Memory Efficient Optimizers with 4-bit States", NeurIPS 2023); rounded up,
  the denominator can only grow. A small ``exp_avg`` rounds to 0, which can only shrink a step.
* A zero block has scale 0 (all codes 0: the code of 0 is 0 in both moments); a non-zero scale is at least 2**-96,
  so that ``127 / scale`` is finite. A NaN moment makes its block's scale NaN: the whole block reads back as NaN.
* Range (never a non-finite state, nor weight, from finite gradients where FP32 Adam's weights stay finite): a
  stored ``|m|`` or ``v`` is at most 2**127; where FP32 Adam's ``v`` overflows to inf (gradients of about 1e20 and
  more, whose update FP32 Adam makes 0 from then on), the state stores ``v`` = 2**127 and ``m`` = 0, which keeps
  that element's steps at ~0, while finite. That step's update is FP32 Adam's.

Why this format (measured side by side against the dynamic tree map of 8-bit Adam, Dettmers et al., "8-bit
Optimizers via Block-wise Quantization", arXiv 2110.02861, FP8 for both moments, a square-root mapping of ``v``, and
a linear int8 ``exp_avg``; docs/PERFORMANCE.md): the int8 code is a multiply and a square root one way and three
multiplies back, and the E4M3 code one float16 conversion and an integer rounding each way, so the update vectorizes
without tables and keeps up with the FP32 kernel, which the dynamic tree (table lookups) and FP8 ``exp_avg`` do not.
The square-root code keeps ``exp_avg`` within 0.79 % of its block's absmax, as the dequantized state must be (within
5 % of each tensor's max), where FP8's 3 or 2 mantissa bits put a value up to 6 % or 12 % off; against the linear
int8 code (1/254 of the absmax, smaller values round to 0) it reaches 2**-14 of the absmax and, on the fine-tuning
task of docs/PERFORMANCE.md, ended at 0.72x and 0.77x its loss in two runs of 18 seeds (level with exact AdamW),
for 2-5 % of the kernel's speed from memory. ``exp_avg_sq``, a denominator, needs relative precision and range: E4M3
gives 1/16 over 14 binades.

Block size: 1024 elements (the ledger's shards start on 1024-element boundaries, so it must divide 1024); its
scales cost 8 bytes per 1024 parameters.

The update of an element is the FP32 kernel's (:func:`cpu_ops.adamw_update`, torch's operation order) on the
decoded moments, except that ``sqrt(v) / bias_correction2_sqrt + eps`` is computed as
``fma(sqrt(v), 1 / bias_correction2_sqrt, eps)`` (one division less; within 1 ulp).
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np

from cpu_ops import _kernels8
from cpu_ops._validate import BF16_BITS, FP32, check_array, check_vector
from cpu_ops.adamw import _GRAD_DTYPES, _hyperparameters, grad_rows

__all__ = [
    "MOMENT_FORMAT",
    "QUANT_BLOCK",
    "adamw8_update",
    "dequantize_blockwise",
    "quantize_blockwise",
]

QUANT_BLOCK: int = 1024
MOMENT_FORMAT: str = "sqrt8-e4m3"  # names the code format above: a checkpoint records which format wrote it
CODES = np.dtype(np.uint8)
_CHUNKS_PER_THREAD = 4


def _check_signed(signed: object) -> bool:
    if not isinstance(signed, bool):
        raise TypeError(f"signed must be a bool, got {type(signed).__name__}")
    return signed


def num_blocks(n: int) -> int:
    """Number of block scales of an n-element array: ceil(n / QUANT_BLOCK)."""
    return -(-n // QUANT_BLOCK)


def _chunks(nblocks: int) -> int:
    return max(1, min(nblocks, numba.get_num_threads() * _CHUNKS_PER_THREAD))


def quantize_blockwise(x: np.ndarray, signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """Codes (uint8, n) and per-block scales (float32, ceil(n / QUANT_BLOCK)) of a float32 vector.

    ``signed=True``: ``exp_avg`` (int8 codes), ``False``: ``exp_avg_sq`` (E4M3 codes; x must be >= 0). The scale is
    the block's absmax; the codes of 0 are 0 in both.
    """
    _check_signed(signed)
    check_vector("x", x, None, (FP32,))
    n = x.shape[0]
    if not signed and n and float(np.min(x)) < 0.0:
        raise ValueError("x has negative values; signed=False is for exp_avg_sq only")
    q = np.empty(n, CODES)
    scales = np.empty(num_blocks(n), np.float32)
    if n:
        _kernels8.quantize_kernel(x, q, scales, QUANT_BLOCK, _chunks(scales.shape[0]), signed)
    return q, scales


def dequantize_blockwise(q: np.ndarray, absmax: np.ndarray, signed: bool) -> np.ndarray:
    """float32 values of codes ``q`` with their block scales ``absmax`` (the inverse of :func:`quantize_blockwise`):
    ``((c * |c|) * float32(1 / 127**2)) * absmax[b]``, c = int8(q[i]), for ``exp_avg``,
    ``e4m3(q[i]) * (absmax[b] * 2**-8)`` for ``exp_avg_sq``, b = i // QUANT_BLOCK."""
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
    ``exp_avg_sq_absmax`` float32 block scales (ceil(n / QUANT_BLOCK),), each its block's absmax (see the module
    docstring).  Element 0 must be a block start (views of the
    ledger start on block boundaries); only the last block may be short.  ``grad``: float32 or uint16 (bf16
    bits), (n,) or (R, n) rows summed in row order after ``* grad_scale`` (as :func:`cpu_ops.adamw_update_sum`).
    ``segments``: int64 (S, 3) of sorted, non-overlapping ``[start, stop, group]`` ranges; ``hyper[group]`` =
    ``(lr, beta1, beta2, eps, weight_decay, decoupled)``.  Elements in a segment get their group's AdamW step
    (and their bf16 bits in ``bf16_out``); the others keep param and ``bf16_out``, and their moments are only
    requantized with the block's new scales.
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
