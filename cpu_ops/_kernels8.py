"""Numba kernels of the 8-bit (block-wise quantized) Adam moments (private; use :mod:`cpu_ops.adamw8`).

The Adam element math, the gradient-row sum and the bf16 rounding are the inline helpers of
:mod:`cpu_ops._kernels`, so the FP32 operation order is the same as the FP32 kernel's.  Numba's
``cache=True`` keys a cached kernel on *this* file only: after editing a helper in ``_kernels.py``,
touch this file too (or clear ``__pycache__``) so the 8-bit kernels are recompiled.

Layout: the arrays are cut into blocks of ``block`` elements (the last one may be shorter); each block
has one float32 absmax per moment.  The parallel loop runs over chunks of whole blocks; each chunk
owns two float32 scratch rows of one block (L1-resident), so a block is read once and written once.

The maps and lookup tables are module constants here (not arguments): Numba freezes them into the
machine code, which lets LLVM vectorize the table lookups as gathers where its cost model for the CPU takes
them (it cannot bound the aliasing of an argument array that is indexed by data; for AMD Zen it scalarizes
them), and ties the cache to this file, which defines them.

Two quantizers of ``y = x / absmax``, both "nearest code, ties to the lower code":

* :func:`quantize_value` (``quantize_blockwise``: conversions, the exact reference) is exact. It looks ``y``
  up in a table indexed by the top 16 bits of ``y`` (sign, exponent, 7 mantissa bits), which gives the lowest
  code the bf16 interval of ``y`` can round to; the tables are built so that at most one code midpoint falls in
  any such interval, so a single comparison with that midpoint finishes the search.
* :func:`grid_code_signed` / :func:`grid_code_unsigned` (the fused update's requantization) use no table, so
  the loop vectorizes without gathers (on AMD Zen, LLVM scalarizes a table lookup, and the whole loop with it).
  Both maps are decades of uniform grids: decade ``e`` holds ``10**-e * (0.1 + 0.9 * (k + 1) / 2**f)``, and its
  ``k = -1`` point is the top code of decade ``e + 1``. Seven comparisons find the decade of ``|y|``; the code is
  then that decade's base index plus ``|y|`` rounded on its grid, in float32. Where ``y`` lies within a few
  float32 ulps of a midpoint, the rounding can take the other neighbour: one code off, at equal distance to
  within those ulps (2 in 4 million uniform values; tests/cpu_ops/test_adamw8.py measures it). They are
  plain functions of one float32, not inlined by Numba: compiled once, LLVM inlines them into the kernel's loop
  and vectorizes it all the same, while Numba-level inlining into each of the kernel's signatures made the
  8-bit warm-up compile 4x longer (250 s against 62 s on a 2-core guest).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from cpu_ops._kernels import _INLINE, KERNEL_OPTIONS, _adam_element, _summed_grad, f32_to_bf16_bits

_U16 = np.uint32(16)
_ABS = np.uint32(0x7FFFFFFF)
_LO = (127 - 26) << 7  # top-16-bit key of 2**-26: every |y| below it shares one table slot
_WIDTH = (127 << 7) - _LO + 2  # keys _LO - 1 (everything smaller) .. key of 1.0


def _dynamic_map(signed: bool) -> np.ndarray:
    """The 256 sorted float32 values of the (signed tree / unsigned) dynamic map, built in float64."""
    magnitudes = []
    fraction_bits = 6 if signed else 7
    for e in range(7):
        f = fraction_bits - e
        k = np.arange(2**f, dtype=np.float64)
        magnitudes.append(10.0**-e * (0.1 + 0.9 * (k + 1) / 2**f))
    positive = np.concatenate(magnitudes)
    values = [np.zeros(1), positive, np.array([1e-7])]
    if signed:
        values.append(-positive)
    out = np.sort(np.concatenate(values)).astype(np.float32)
    if out.shape != (256,) or not np.all(np.diff(out) > 0):
        raise AssertionError("dynamic map construction is wrong")  # construction invariant
    return out


def _search_tables(code: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Midpoints (+inf sentinel) and the packed bf16-interval table of :func:`quantize_value`.

    Entry of an interval (the floats sharing the top 16 bits, or all |y| < 2**-26): bits 0..7 the lowest code
    ``base`` of the interval; bits 8..23 the low 16 bits of the one midpoint inside it, flipped for y < 0 so
    that "y above the midpoint" is an unsigned ``>`` of the flipped low bits in both signs (0xFFFF: none).
    """
    mid = np.empty(256, np.float32)
    mid[:255] = ((code[:-1].astype(np.float64) + code[1:].astype(np.float64)) / 2).astype(np.float32)
    mid[255] = np.inf
    mags = np.arange(_LO - 1, _LO - 1 + _WIDTH, dtype=np.uint32)
    entries = []
    for sign in (0, 1):
        key = (np.uint32(sign << 15) | mags) << np.uint32(16)
        first = key.copy()
        last = key | np.uint32(0xFFFF)
        first[0] = np.uint32(sign << 31)  # the lumped slot: +-0 .. the largest |y| below 2**-26
        low = (last if sign else first).view(np.float32)  # the interval's smallest value
        high = (first if sign else last).view(np.float32)
        base = np.searchsorted(mid, low, side="left")
        inside = np.searchsorted(mid, high, side="left") - base
        if np.any(inside > 1) or inside[0] != 0:
            raise AssertionError("a bf16 interval holds two code midpoints; the lookup needs more mantissa bits")
        m_low = mid[np.minimum(base, 255)].view(np.uint32) & np.uint32(0xFFFF)
        flipped = np.where(inside == 1, m_low ^ np.uint32(0xFFFF * sign), np.uint32(0xFFFF))
        entries.append(base.astype(np.uint32) | (flipped.astype(np.uint32) << np.uint32(8)))
    return mid, np.concatenate(entries).astype(np.int32)


S_CODE = _dynamic_map(signed=True)
U_CODE = _dynamic_map(signed=False)
S_MID, S_TABLE = _search_tables(S_CODE)
U_MID, U_TABLE = _search_tables(U_CODE)
S_ZERO = np.uint8(np.searchsorted(S_MID, np.float32(0.0), side="left"))
U_ZERO = np.uint8(0)


def _decade_rows(code: np.ndarray, signed: bool) -> tuple[tuple[np.float32, np.float32, np.float32, np.float32], ...]:
    """Per decade ``e`` = 0..7 of the map: (``|y| <= top`` selects it, its ``k = -1`` point ``low``, grid points
    per unit ``1 / step``, code index of ``low``), float32. Decade 7 is the interval [0, 1e-7] of the codes 0, 1e-7."""
    top = [code[np.argmin(np.abs(code.astype(np.float64) - 10.0**-e))] for e in range(8)] + [np.float32(0.0)]
    rows = []
    for e in range(8):
        f = (6 if signed else 7) - e
        per_unit = 1.0 / float(top[7]) if e == 7 else 2.0**f / (0.9 * 10.0**-e)
        base = 127 + (2**f if e < 7 else 0) if signed else (2**f - 1 if e < 7 else 0)
        if code[base] != top[e + 1]:
            raise AssertionError("the decade grid does not match the map")  # construction invariant
        rows.append((np.float32(top[e]), np.float32(top[e + 1]), np.float32(per_unit), np.float32(base)))
    return tuple(rows)


S_ROWS = _decade_rows(S_CODE, signed=True)
U_ROWS = _decade_rows(U_CODE, signed=False)
_NEG_SMALL_MID = np.float32(-S_MID[126])  # |midpoint| of -1e-6 and 0: the signed map has no -1e-7
_HALF = np.float32(0.5)
_SIGN = np.uint32(0x80000000)


@njit(**_INLINE)
def quantize_value(y, table):
    """Index of the code nearest to ``y`` (float32 in [-1, 1]): ``searchsorted(mid, y, 'left')``.

    One lookup in the packed table of :func:`_search_tables` by the top 16 bits of y (clamped to the range
    of |y| that has an entry), then one integer comparison of y's low 16 bits with that interval's midpoint.
    """
    # every intermediate is cast back to uint32 so that the vectorized loop works on 32-bit lanes
    bits = np.float32(y).view(np.uint32)
    neg = np.uint32(np.int32(bits) >> np.int32(31))  # all ones for y < 0
    mag = np.uint32((bits >> _U16) & np.uint32(0x7FFF))
    mag = np.uint32(min(max(mag, np.uint32(_LO - 1)), np.uint32(_LO + _WIDTH - 2)))
    slot = np.uint32(np.uint32(mag - np.uint32(_LO - 1)) + np.uint32(neg & np.uint32(_WIDTH)))
    entry = np.uint32(table[slot & np.uint32(0x1FFF)])  # unsigned, < 2**13 (a no-op): 32-bit gather indices
    low = np.uint32((bits & np.uint32(0xFFFF)) ^ (neg & np.uint32(0xFFFF)))
    above = np.uint32(low > np.uint32(entry >> np.uint32(8)))
    return np.uint8(np.uint32(entry & np.uint32(0xFF)) + above)


@njit(**_INLINE)
def _pick(a, row, low, per_unit, base):
    take = a <= row[0]
    return (row[1] if take else low), (row[2] if take else per_unit), (row[3] if take else base)


@njit(**_INLINE)
def _on_grid(a, rows):
    """(``a`` in grid steps above its decade's ``low``, clamped to [0, 256] and NaN -> 0; the decade's base)."""
    low, per_unit, base = rows[0][1], rows[0][2], rows[0][3]
    low, per_unit, base = _pick(a, rows[1], low, per_unit, base)
    low, per_unit, base = _pick(a, rows[2], low, per_unit, base)
    low, per_unit, base = _pick(a, rows[3], low, per_unit, base)
    low, per_unit, base = _pick(a, rows[4], low, per_unit, base)
    low, per_unit, base = _pick(a, rows[5], low, per_unit, base)
    low, per_unit, base = _pick(a, rows[6], low, per_unit, base)
    low, per_unit, base = _pick(a, rows[7], low, per_unit, base)
    u = (a - low) * per_unit
    return min(max(u, np.float32(0.0)) if u == u else np.float32(0.0), np.float32(256.0)), base


@njit(**_INLINE)
def _code_index(index):
    return np.uint8(min(max(index, np.float32(0.0)), np.float32(255.0)))


@njit(nogil=True, error_model="numpy")
def grid_code_unsigned(y):
    """Code of ``y`` (float32 in [0, 1]) on the unsigned map, without a table (see the module docstring)."""
    u, base = _on_grid(y, U_ROWS)
    return _code_index(base + np.ceil(u - _HALF))


@njit(nogil=True, error_model="numpy")
def grid_code_signed(y):
    """Code of ``y`` (float32 in [-1, 1]) on the signed map, without a table (see the module docstring).

    Negative values mirror the positive codes (index 255 - i), ties going to the larger magnitude (the lower
    code), except below 1e-6, where the negative side has only -1e-6 and 0."""
    bits = np.float32(y).view(np.uint32)
    a = np.uint32(bits & _ABS).view(np.float32)
    u, base = _on_grid(a, S_ROWS)
    positive = base + np.ceil(u - _HALF)
    small = np.float32(128.0) + (np.float32(1.0) if a >= _NEG_SMALL_MID else np.float32(0.0))
    negative = np.float32(255.0) - (small if a <= S_ROWS[6][0] else base + np.floor(u + _HALF))
    return _code_index(negative if bits >= _SIGN else positive)


@njit(**_INLINE)
def _absmax(x, length):
    """max |x[:length]| via the integer order of the float32 bits (vectorizes; a NaN propagates)."""
    top = np.uint32(0)
    for j in range(length):
        bits = np.float32(x[j]).view(np.uint32) & _ABS
        top = np.uint32(max(top, bits))
    return np.uint32(top).view(np.float32)


@njit(**_INLINE)
def _requantize(x, length, out, start, table, zero_code, floor):
    """out[start + j] = nearest code of x[j] / absmax, at least ``floor`` for x[j] > 0; returns the block's new
    absmax. ``floor`` 1 (the unsigned map of exp_avg_sq): a positive second moment is never stored as 0 (see
    :mod:`cpu_ops.adamw8`, "the zero guard"); 0: nearest code only."""
    amax = _absmax(x, length)
    if amax > np.float32(0.0):
        for j in range(length):
            code = quantize_value(x[j] / amax, table)
            positive = np.uint8(np.uint8(x[j] > np.float32(0.0)) & floor)
            out[np.uint64(start + j)] = max(code, positive)
    else:
        for j in range(length):
            out[np.uint64(start + j)] = zero_code
    return amax


@njit(**_INLINE)
def _requantize_on_grid(x, length, out, start, signed):
    """:func:`_requantize` with the table-free codes; the zero guard for the unsigned map."""
    amax = _absmax(x, length)
    if amax > np.float32(0.0):
        for j in range(length):
            y = x[j] / amax
            if signed:
                out[np.uint64(start + j)] = grid_code_signed(y)
            else:
                out[np.uint64(start + j)] = max(grid_code_unsigned(y), np.uint8(x[j] > np.float32(0.0)))
    else:
        for j in range(length):
            out[np.uint64(start + j)] = S_ZERO if signed else U_ZERO
    return amax


@njit(**KERNEL_OPTIONS)
def quantize_kernel(x, q, absmax, block, chunks, signed, grid):
    """Block-wise quantization of ``x`` into codes ``q`` and per-block ``absmax`` (signed or unsigned map);
    ``grid``: with the fused update's table-free codes (tests compare them with the exact ones)."""
    n = x.shape[0]
    nblocks = absmax.shape[0]
    for c in prange(chunks):
        for b in range(c * nblocks // chunks, (c + 1) * nblocks // chunks):
            s = b * block
            e = min(s + block, n)
            if grid:
                absmax[b] = _requantize_on_grid(x[s:e], e - s, q, s, signed)
            elif signed:
                absmax[b] = _requantize(x[s:e], e - s, q, s, S_TABLE, S_ZERO, np.uint8(0))
            else:
                absmax[b] = _requantize(x[s:e], e - s, q, s, U_TABLE, U_ZERO, np.uint8(1))


@njit(**KERNEL_OPTIONS)
def dequantize_kernel(q, absmax, out, block, signed):
    """out[i] = code[q[i]] * absmax[i // block] (the signed or the unsigned map)."""
    for i in prange(q.shape[0]):
        out[i] = (S_CODE[q[i]] if signed else U_CODE[q[i]]) * absmax[i // block]


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


@njit(**_INLINE)
def _dequantize_range(mq, vq, m, v, s, first, last, am, av):
    """Scratch rows m, v (block-relative) of elements first..last-1 from their codes (a frozen gap)."""
    for t in range(last - first):
        i = np.uint64(first + t)  # unsigned indices: no wraparound code, so the loops vectorize
        j = np.uint64(first - s + t)
        m[j] = S_CODE[mq[i]] * am
        v[j] = U_CODE[vq[i]] * av


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
):
    """Fused 8-bit AdamW: per block dequantize, update the segments' elements, requantize.

    ``hyper[group]`` holds the float32 scalars of :func:`cpu_ops.adamw._hyperparameters` without
    ``grad_scale`` (flags as 0/1).  ``bf16_out`` is None or a uint16 array (pruned at compile time).
    One pass over the block's elements in order: frozen gaps are dequantized, segment pieces are
    dequantized and updated in the same loop; then both moments are requantized from the scratch rows.
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
            am = m_absmax[b]
            av = v_absmax[b]
            while k0 < nseg and segments[k0, 1] <= s:
                k0 += 1
            k = k0
            pos = s
            while k < nseg and segments[k, 0] < e:
                first = max(segments[k, 0], s)
                last = min(segments[k, 1], e)
                if first > pos:
                    _dequantize_range(mq, vq, m, v, s, pos, first, am, av)
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
                for t in range(last - first):
                    i = np.uint64(first + t)
                    j = np.uint64(first - s + t)
                    g = _summed_grad(grads, i, grad_scale)
                    p, mm, vv = _adam_element(
                        param[i],
                        S_CODE[mq[i]] * am,
                        U_CODE[vq[i]] * av,
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
                    m[j] = mm
                    v[j] = vv
                    if bf16_out is not None:
                        bf16_out[i] = f32_to_bf16_bits(p)
                pos = last
                k += 1
            if e > pos:
                _dequantize_range(mq, vq, m, v, s, pos, e, am, av)
            m_absmax[b] = _requantize_on_grid(m, e - s, mq, s, True)
            v_absmax[b] = _requantize_on_grid(v, e - s, vq, s, False)


@njit(**KERNEL_OPTIONS)
def adam8_shaped_copy_kernel(param, mq, vq, m_absmax, v_absmax, grads, bf16_out):
    """Moves exactly the bytes of :func:`adamw8_kernel` with trivial math: that update's bandwidth ceiling.

    A flat pass over the elements (param -= g, codes += 1, truncated bf16 copy), then one over the scales.
    """
    one = np.float32(1.0)
    for i in prange(param.shape[0]):
        g = _summed_grad(grads, i, one)
        p = param[i] - g
        param[i] = p
        mq[i] = np.uint8(mq[i] + np.uint8(1))
        vq[i] = np.uint8(vq[i] + np.uint8(1))
        if bf16_out is not None:
            bf16_out[i] = np.uint16(np.float32(p).view(np.uint32) >> _U16)
    for b in prange(m_absmax.shape[0]):
        m_absmax[b] = m_absmax[b] + one
        v_absmax[b] = v_absmax[b] + one
