"""Numba kernels of the 8-bit (block-wise quantized) Adam moments (private; use :mod:`cpu_ops.adamw8`).

The Adam element math, the gradient-row sum and the bf16 rounding are the inline helpers of
:mod:`cpu_ops._kernels`, so the FP32 operation order is the same as the FP32 kernel's.  Numba's
``cache=True`` keys a cached kernel on *this* file only: after editing a helper in ``_kernels.py``,
touch this file too (or clear ``__pycache__``) so the 8-bit kernels are recompiled.

Layout: the arrays are cut into blocks of ``block`` elements (the last one may be shorter); each block
has one float32 absmax per moment.  The parallel loop runs over chunks of whole blocks; each chunk
owns two float32 scratch rows of one block (L1-resident), so a block is read once and written once.

Quantization (exact nearest code, ties to the lower code): ``y = x / absmax`` is looked up in a table
indexed by the top 16 bits of ``y`` (sign, exponent, 7 mantissa bits), which gives the lowest code the
bf16 interval of ``y`` can round to; the tables are built so that at most one code midpoint falls in
any such interval, so a single comparison with that midpoint finishes the search.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from cpu_ops._kernels import _INLINE, KERNEL_OPTIONS, _adam_element, _summed_grad, f32_to_bf16_bits

_U16 = np.uint32(16)
_ABS = np.uint32(0x7FFFFFFF)


@njit(**_INLINE)
def quantize_value(y, table, mid, lo, width):
    """Index of the code nearest to ``y`` (float32 in [-1, 1]): ``searchsorted(mid, y, 'left')``.

    ``table[sign * width + clamp(mag16, lo - 1, lo + width - 2) - (lo - 1)]`` is the lowest candidate
    code of y's bf16 interval (``mag16``: the top 16 bits of |y|); ``mid`` has a +inf sentinel at 255.
    """
    key = np.int64(np.float32(y).view(np.uint32) >> _U16)
    sign = key >> 15
    mag = key & 0x7FFF
    mag = min(max(mag, lo - 1), lo + width - 2) - (lo - 1)
    base = np.int64(table[sign * width + mag])
    return np.uint8(base + (1 if y > mid[base] else 0))


@njit(**_INLINE)
def _absmax(x, length):
    """max |x[:length]| via the integer order of the float32 bits (vectorizes; a NaN propagates)."""
    top = np.uint32(0)
    for j in range(length):
        bits = np.float32(x[j]).view(np.uint32) & _ABS
        top = np.uint32(max(top, bits))
    return np.uint32(top).view(np.float32)


@njit(**_INLINE)
def _requantize(x, length, out, start, table, mid, lo, width, zero_code):
    """out[start + j] = nearest code of x[j] / absmax; returns the block's new absmax."""
    amax = _absmax(x, length)
    if amax > np.float32(0.0):
        for j in range(length):
            out[start + j] = quantize_value(x[j] / amax, table, mid, lo, width)
    else:
        for j in range(length):
            out[start + j] = zero_code
    return amax


@njit(**KERNEL_OPTIONS)
def quantize_kernel(x, q, absmax, block, chunks, table, mid, lo, width, zero_code):
    """Block-wise quantization of ``x`` into codes ``q`` and per-block ``absmax``."""
    n = x.shape[0]
    nblocks = absmax.shape[0]
    for c in prange(chunks):
        for b in range(c * nblocks // chunks, (c + 1) * nblocks // chunks):
            s = b * block
            e = min(s + block, n)
            absmax[b] = _requantize(x[s:e], e - s, q, s, table, mid, lo, width, zero_code)


@njit(**KERNEL_OPTIONS)
def dequantize_kernel(q, absmax, out, block, code):
    """out[i] = code[q[i]] * absmax[i // block]."""
    for i in prange(q.shape[0]):
        out[i] = code[q[i]] * absmax[i // block]


@njit(**_INLINE)
def _first_segment(segments, s):
    """Index of the first segment whose stop is > s (segments sorted and non-overlapping)."""
    lo, hi = 0, segments.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        if segments[mid, 1] <= s:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(**KERNEL_OPTIONS)
def adamw8_kernel(
    param,
    mq,
    vq,
    m_absmax,
    v_absmax,
    grads,
    bf16_out,
    segments,
    hyper,
    grad_scale,
    block,
    chunks,
    s_code,
    u_code,
    s_table,
    u_table,
    s_mid,
    u_mid,
    lo,
    width,
    s_zero,
    u_zero,
):
    """Fused 8-bit AdamW: per block dequantize, update the segments' elements, requantize.

    ``hyper[group]`` holds the float32 scalars of :func:`cpu_ops.adamw._hyperparameters` without
    ``grad_scale`` (flags as 0/1).  ``bf16_out`` is None or a uint16 array (pruned at compile time).
    """
    n = param.shape[0]
    nblocks = m_absmax.shape[0]
    nseg = segments.shape[0]
    for c in prange(chunks):
        b0 = c * nblocks // chunks
        b1 = (c + 1) * nblocks // chunks
        m = np.empty(block, np.float32)
        v = np.empty(block, np.float32)
        k0 = _first_segment(segments, b0 * block)
        for b in range(b0, b1):
            s = b * block
            e = min(s + block, n)
            length = e - s
            am = m_absmax[b]
            av = v_absmax[b]
            for j in range(length):
                m[j] = s_code[mq[s + j]] * am
                v[j] = u_code[vq[s + j]] * av
            while k0 < nseg and segments[k0, 1] <= s:
                k0 += 1
            k = k0
            while k < nseg and segments[k, 0] < e:
                first = max(segments[k, 0], s)
                last = min(segments[k, 1], e)
                h = hyper[segments[k, 2]]
                apply_decay = h[0] != 0
                decay = h[1]
                apply_l2 = h[2] != 0
                weight_decay = h[3]
                lerp_small = h[4] != 0
                lerp_coeff = h[5]
                beta2 = h[6]
                one_minus_beta2 = h[7]
                bc2_sqrt = h[8]
                eps = h[9]
                neg_step_size = h[10]
                for i in range(first, last):
                    g = _summed_grad(grads, i, grad_scale)
                    p, mm, vv = _adam_element(
                        param[i],
                        m[i - s],
                        v[i - s],
                        g,
                        apply_decay,
                        decay,
                        apply_l2,
                        weight_decay,
                        lerp_small,
                        lerp_coeff,
                        beta2,
                        one_minus_beta2,
                        bc2_sqrt,
                        eps,
                        neg_step_size,
                    )
                    param[i] = p
                    m[i - s] = mm
                    v[i - s] = vv
                    if bf16_out is not None:
                        bf16_out[i] = f32_to_bf16_bits(p)
                k += 1
            m_absmax[b] = _requantize(m, length, mq, s, s_table, s_mid, lo, width, s_zero)
            v_absmax[b] = _requantize(v, length, vq, s, u_table, u_mid, lo, width, u_zero)


@njit(**KERNEL_OPTIONS)
def adam8_shaped_copy_kernel(param, mq, vq, m_absmax, v_absmax, grads, bf16_out, block, chunks):
    """Moves exactly the bytes of :func:`adamw8_kernel` with trivial math: that update's bandwidth ceiling."""
    n = param.shape[0]
    nblocks = m_absmax.shape[0]
    one = np.float32(1.0)
    for c in prange(chunks):
        for b in range(c * nblocks // chunks, (c + 1) * nblocks // chunks):
            s = b * block
            e = min(s + block, n)
            for i in range(s, e):
                g = _summed_grad(grads, i, one)
                p = param[i] - g
                param[i] = p
                mq[i] = np.uint8(mq[i] + np.uint8(1))
                vq[i] = np.uint8(vq[i] + np.uint8(1))
                if bf16_out is not None:
                    bf16_out[i] = np.uint16(np.float32(p).view(np.uint32) >> _U16)
            m_absmax[b] = m_absmax[b] + one
            v_absmax[b] = v_absmax[b] + one
