"""Numba kernels of the 8-bit (block-wise square-root int8 and FP8 E4M3) Adam moments (private; use
:mod:`cpu_ops.adamw8`).

The format is described in :mod:`cpu_ops.adamw8`. ``exp_avg``: the int8 code, ``127 * sqrt(|m| / scale)`` rounded
and signed, is one multiply, one square root (``vsqrtps``), a sign copy and one addition whose float32 result holds
the rounded integer in its low byte; back, one int8 -> float32 conversion and three multiplies. ``exp_avg_sq``:
an E4M3 code of a value in [0, 256] is bits 7..14 of the IEEE half-precision number value / 2**8 (exponent field and
3 mantissa bits, subnormals included), so encoding is one float32 -> float16 conversion (``vcvtps2ph``, LLVM's
``fptrunc``) and an integer rounding, decoding a shift and one float16 -> float32 conversion (``vcvtph2ps``). No
tables, no branches: every loop vectorizes.

The gradient-row sum and the bf16 rounding are the inline helpers of :mod:`cpu_ops._kernels`. Numba's
``cache=True`` keys a cached kernel on *this* file only: after editing a helper in ``_kernels.py``, touch this
file too (or clear ``__pycache__``) so the 8-bit kernels are recompiled.

Layout: the arrays are cut into blocks of ``block`` elements (the last one may be shorter); each block has one
float32 scale per moment. The parallel loop runs over chunks of whole blocks; each chunk owns two float32 scratch
rows of one block (L1-resident). Per block, one pass decodes, updates and writes the parameter, its bf16 copy and
the new ``exp_avg`` and ``exp_avg_sq`` to the scratch rows while taking their absmax; a second pass encodes both
rows with the new scales, LANES elements at a time as explicit LLVM vectors (:func:`_encode_lanes_intrinsic`; the
last ``len % LANES`` elements of a block by the scalar functions, bit for bit the same). Around them the next block's
master and gradient are prefetched (see :func:`adamw8_kernel`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_ops._kernels import _INLINE, KERNEL_OPTIONS, _fma, _summed_grad, f32_to_bf16_bits

_U7 = np.uint32(7)
_U16 = np.uint32(16)
_ABS = np.uint32(0x7FFFFFFF)
_TO_F16 = np.uint32(0xFFFFE000)  # keeps float16's 11 significant bits of a float32: the conversion is then exact
_ZERO = np.float32(0.0)
_HALF7 = np.uint32(0x40)
_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23: x + _MAGIC holds round(x) in its low bits (|x| < 2**22)
_SQ = np.float32(127.0 * 127.0)  # the square of the int8 code of a block's absmax of exp_avg
_INV_SQ = np.float32(1.0) / _SQ  # 16129 * _INV_SQ == 1 in float32

SCALE_MIN = np.float32(2.0**-96)  # a non-zero block scale is at least this, so that 1 / scale is finite
MOMENT_MAX = np.float32(2.0**127)  # a stored |exp_avg| or exp_avg_sq is at most this (never inf)


@intrinsic
def _f32_to_f16_bits_intrinsic(typingctx, x):
    """float32 -> IEEE float16 bits (uint16), round to nearest even (``fptrunc``: ``vcvtps2ph`` with F16C)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def _f16_bits_to_f32_intrinsic(typingctx, x):
    """IEEE float16 bits (uint16) -> float32, exact (``fpext``: ``vcvtph2ps`` with F16C)."""
    if x != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _prefetch_intrinsic(typingctx, arr, index):
    """Prefetch the cache line holding ``arr[index]`` for reading into the L2 cache (``llvm.prefetch`` with locality
    2: ``prefetcht1`` on x86). A hint: it never faults, but callers keep ``index`` in bounds. Into L2, not L1
    (``prefetcht0``): on Zen 4 a half block of L1 prefetches ahead of the loop made the 8-bit update 8-25 % slower
    than none at all (1 thread, 64 M parameters), the L2 ones 20-35 % faster than the L1 ones (docs/PERFORMANCE.md);
    the core's own L1 prefetcher streams from L2."""
    if not isinstance(arr, types.Array) or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
        prefetch = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(prefetch, [ptr, i32(0), i32(2), i32(1)])  # read, into L2 (prefetcht1), data
        return context.get_dummy_value()

    return types.none(arr, index), codegen


LANES = 16  # elements of one explicit vector step of the encode pass: two AVX2 registers, one AVX-512 register


def _lanes(ty: ir.Type) -> ir.VectorType:
    return ir.VectorType(ty, LANES)


def _splat(ty: ir.Type, value: float | int) -> ir.Constant:
    return ir.Constant(_lanes(ty), [ir.Constant(ty, value)] * LANES)


@intrinsic
def _encode_lanes_intrinsic(typingctx, m, r, mq, vq, i, j, inv_m, inv_v):
    """``mq[i:i+LANES]``, ``vq[i:i+LANES]`` = the codes of scratch rows ``m[j:j+LANES]``, ``r[j:j+LANES]``: LANES
    elements of :func:`encode_signed` and :func:`encode_unsigned`, bit for bit, as one LLVM vector each.

    Written as vectors, not left to the loop vectorizer, for the narrowing: each code leaves its 32-bit (exp_avg)
    or 16-bit (exp_avg_sq) lane masked to its low byte, so LLVM narrows 16 of them with saturating packs (AVX2: four
    instructions for exp_avg's, two for exp_avg_sq's; AVX-512: one ``vpmovdb``/``vpmovwb``) where the vectorizer's
    8-lane truncation took five per 8. The sign of exp_avg's code is OR-ed into its non-negative square root (no
    ``copysign`` select); exp_avg_sq's rounding runs on 16-bit lanes straight from the float16 conversion."""
    rows, codes = (m, r), (mq, vq)
    if not (
        all(isinstance(a, types.Array) and a.dtype == types.float32 for a in rows)
        and all(isinstance(a, types.Array) and a.dtype == types.uint8 for a in codes)
        and all(isinstance(k, types.Integer) for k in (i, j))
        and inv_m == inv_v == types.float32
    ):
        return None

    def codegen(context, builder, signature, args):
        m, r, mq, vq, i, j, inv_m, inv_v = args
        f32, i32, i16, i8 = ir.FloatType(), ir.IntType(32), ir.IntType(16), ir.IntType(8)
        vf, vi32, vi16 = _lanes(f32), _lanes(i32), _lanes(i16)

        def lanes_at(arg: int, array, index, elem: ir.Type):
            data = context.make_array(signature.args[arg])(context, builder, array).data
            return builder.bitcast(builder.gep(data, [index]), _lanes(elem).as_pointer())

        def broadcast(x):
            first = builder.insert_element(ir.Constant(vf, ir.Undefined), x, ir.Constant(i32, 0))
            return builder.shuffle_vector(first, ir.Constant(vf, ir.Undefined), ir.Constant(vi32, [0] * LANES))

        def narrow_store(code, pointer):
            builder.store(builder.trunc(code, _lanes(i8)), pointer, align=1)

        sqrt = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf]), f"llvm.sqrt.v{LANES}f32")
        # exp_avg: low byte of (sqrt(|x| * inv) with x's sign) + 1.5 * 2**23
        x = builder.bitcast(builder.load(lanes_at(0, m, j, f32), align=4), vi32)
        magnitude = builder.bitcast(builder.and_(x, _splat(i32, int(_ABS))), vf)
        root = builder.bitcast(builder.call(sqrt, [builder.fmul(magnitude, broadcast(inv_m))]), vi32)
        signed = builder.or_(root, builder.and_(x, _splat(i32, 0x80000000)))  # root's sign bit is 0, NaN too
        code = builder.bitcast(builder.fadd(builder.bitcast(signed, vf), _splat(f32, float(_MAGIC))), vi32)
        narrow_store(builder.and_(code, _splat(i32, 0xFF)), lanes_at(2, mq, i, i8))
        # exp_avg_sq: bits 7..14 of the float16 of v * inv truncated to float16's precision, rounded; >= 1 for v > 0
        v = builder.load(lanes_at(1, r, j, f32), align=4)
        y = builder.and_(builder.bitcast(builder.fmul(v, broadcast(inv_v)), vi32), _splat(i32, int(_TO_F16)))
        h = builder.bitcast(builder.fptrunc(builder.bitcast(y, vf), _lanes(ir.HalfType())), vi16)
        magnitude16 = builder.lshr(builder.add(h, _splat(i16, int(_HALF7))), _splat(i16, int(_U7)))
        positive = builder.zext(builder.fcmp_ordered(">", v, _splat(f32, 0.0)), vi16)
        code16 = builder.select(builder.icmp_unsigned(">", magnitude16, positive), magnitude16, positive)
        narrow_store(builder.and_(code16, _splat(i16, 0xFF)), lanes_at(3, vq, i, i8))
        return context.get_dummy_value()

    return types.none(m, r, mq, vq, i, j, inv_m, inv_v), codegen


# As called from compiled code (Numba supplies ``typingctx``; see ``cpu_ops._kernels._fma``).
_f32_to_f16_bits = cast("Callable[[np.float32], np.uint16]", _f32_to_f16_bits_intrinsic)
_f16_bits_to_f32 = cast("Callable[[np.uint16], np.float32]", _f16_bits_to_f32_intrinsic)
_prefetch = cast("Callable[[np.ndarray, int], None]", _prefetch_intrinsic)
_encode_lanes = cast("Callable[..., None]", _encode_lanes_intrinsic)
_LINE = 64  # bytes per cache line


@njit(**_INLINE)
def _f16_trunc(y):
    """float16 bits of float32 ``y`` truncated to float16's precision (exact where float16 is normal, |y| >= 2**-14;
    below it, the conversion rounds to nearest even: one code off at most, at a float16 tie)."""
    return np.uint32(_f32_to_f16_bits(np.uint32(np.float32(y).view(np.uint32) & _TO_F16).view(np.float32)))


@njit(**_INLINE)
def decode_signed(code, scale):
    """``exp_avg`` value of the int8 ``code`` (two's complement, -127..127): ((code * |code|) * (1 / 127**2)) * scale.
    code * |code| is exact and the second product is exact at +-127 (16129 * float32(1 / 16129) == 1), so the
    block's absmax element reads back exactly."""
    c = np.float32(np.int8(code))
    return ((c * abs(c)) * _INV_SQ) * scale


@njit(**_INLINE)
def encode_signed(x, inv):
    """int8 code of ``exp_avg`` element ``x``: sign(x) * sqrt(|x| * inv) rounded to the nearest integer, ties to even
    (``inv`` = 127**2 / the block's scale, so the result is in -127..127); adding 1.5 * 2**23 puts that integer in
    the low byte of the float32's bits, in two's complement."""
    return np.uint8(np.float32(np.copysign(np.sqrt(abs(x) * inv), x) + _MAGIC).view(np.uint32))


@njit(**_INLINE)
def decode_unsigned(code, scale):
    """``exp_avg_sq`` value of E4M3 ``code`` (sign bit 0)."""
    return _f16_bits_to_f32(np.uint16(np.uint32(code) << _U7)) * scale


@njit(**_INLINE)
def encode_unsigned(v, inv):
    """E4M3 code of ``exp_avg_sq`` element ``v >= 0``; ``inv`` = 1 / the block's scale (v * inv <= 1, E4M3 256).
    Nearest, ties away from zero (float16 of v * inv truncated to float16's precision, exact where float16 is normal;
    its bits 7..14 rounded half up), and at least 1 for v > 0 (the zero guard)."""
    h = _f16_trunc(v * inv)
    mag = np.uint32(np.uint32(h + _HALF7) >> _U7)
    return np.uint8(max(mag, np.uint32(v > _ZERO)))


@njit(**_INLINE)
def block_scale(top):
    """A block's stored scale from the absmax of its new values: 0 stays 0, NaN stays NaN, else >= SCALE_MIN."""
    if top >= SCALE_MIN:
        return top
    return SCALE_MIN if top > _ZERO else top


@njit(**_INLINE)
def _inverse(top, scale):
    """top / scale, 0 for a zero scale (finite: scale >= SCALE_MIN)."""
    return top / scale if scale != _ZERO else _ZERO


@njit(**_INLINE)
def _absmax(x, length):
    """max |x[:length]| via the integer order of the float32 bits (vectorizes; a NaN propagates)."""
    top = np.uint32(0)
    for j in range(length):
        top = np.uint32(max(top, np.float32(x[j]).view(np.uint32) & _ABS))
    return np.uint32(top).view(np.float32)


@njit(**KERNEL_OPTIONS)
def quantize_kernel(x, q, scales, block, chunks, signed):
    """Block-wise codes ``q`` and ``scales`` of ``x``: ``exp_avg`` (signed) or ``exp_avg_sq`` (x >= 0)."""
    n = x.shape[0]
    nblocks = scales.shape[0]
    for c in prange(chunks):
        for b in range(c * nblocks // chunks, (c + 1) * nblocks // chunks):
            s = b * block
            e = min(s + block, n)
            top = _absmax(x[s:e], e - s)
            saturate = top > MOMENT_MAX  # NaN: False
            scale = block_scale(MOMENT_MAX if saturate else top)
            inv = _inverse(_SQ if signed else np.float32(1.0), scale)
            for j in range(e - s):
                xj = x[s + j]
                if saturate:
                    xj = min(max(xj, -MOMENT_MAX), MOMENT_MAX)
                q[np.uint64(s + j)] = encode_signed(xj, inv) if signed else encode_unsigned(xj, inv)
            scales[b] = scale


@njit(**KERNEL_OPTIONS)
def dequantize_kernel(q, scales, out, block, signed):
    """out[i] = the value of code q[i] with the scale of block i // block."""
    for i in prange(q.shape[0]):
        out[i] = decode_signed(q[i], scales[i // block]) if signed else decode_unsigned(q[i], scales[i // block])


@njit(**_INLINE)
def _prefetch_lines(a, lo, hi):
    """Prefetch the cache lines of a[lo:hi]."""
    for i in range(lo, hi, _LINE // a.itemsize):
        _prefetch(a, i)


@njit(**_INLINE)
def _prefetch_inputs(param, grads, lo, hi):
    """Prefetch the master and the gradient rows of elements lo..hi-1 (the streams read from memory that dominate the
    update's bytes; the codes and the bf16 copy are left to the hardware prefetchers, measured faster)."""
    _prefetch_lines(param, lo, hi)
    for row in grads:
        _prefetch_lines(row, lo, hi)


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
def _decode_range(mq, vq, m, r, s, first, last, scale_m, scale_v):
    """Scratch rows (block-relative) of the frozen elements first..last-1; returns the tops of their m and v."""
    top_m = np.uint32(0)
    top_v = np.uint32(0)
    for t in range(last - first):
        i = np.uint64(first + t)  # unsigned indices: no wraparound code, so the loops vectorize
        j = np.uint64(first - s + t)
        mm = decode_signed(mq[i], scale_m)
        vv = decode_unsigned(vq[i], scale_v)
        m[j] = mm
        r[j] = vv
        top_m = np.uint32(max(top_m, np.float32(mm).view(np.uint32) & _ABS))
        top_v = np.uint32(max(top_v, np.float32(vv).view(np.uint32) & _ABS))
    return top_m, top_v


@njit(**_INLINE)
def _update_range(
    param,
    mq,
    vq,
    m,
    r,
    grads,
    bf16_out,
    s,
    first,
    last,
    scale_m,
    scale_v,
    grad_scale,
    decay,
    weight_decay,
    lerp_small,
    lerp_coeff,
    beta2,
    one_minus_beta2,
    inv_bc2_sqrt,
    eps,
    neg_step_size,
):
    """AdamW on elements first..last-1 from their decoded moments (torch's ``_single_tensor_adam`` operation order,
    see :mod:`cpu_ops._kernels`, except the denominator); new m and v to the scratch rows; returns their tops.

    ``decay`` is 1 and ``weight_decay`` 0 where a group has none (exact identities), so the loop has no flag branch;
    ``lerp_small`` is a compile-time constant at each call site. ``sqrt(v) / bias_correction2_sqrt + eps`` is
    ``fma(sqrt(v), 1 / bias_correction2_sqrt, eps)``: one division less per element, within 1 ulp of the FP32
    kernel's denominator."""
    top_m = np.uint32(0)
    top_v = np.uint32(0)
    for t in range(last - first):
        i = np.uint64(first + t)
        j = np.uint64(first - s + t)
        g = _summed_grad(grads, i, grad_scale)
        mm = decode_signed(mq[i], scale_m)
        vv = decode_unsigned(vq[i], scale_v)
        p = param[i] * decay  # param.mul_(1 - lr * weight_decay)
        g = _fma(p, weight_decay, g)  # grad.add(param, alpha=weight_decay)
        mm = _fma(lerp_coeff, g - mm, mm if lerp_small else g)  # exp_avg.lerp_(grad, 1 - beta1)
        vv = _fma(one_minus_beta2 * g, g, vv * beta2)  # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
        p = p + (neg_step_size * mm) / _fma(np.sqrt(vv), inv_bc2_sqrt, eps)  # param.addcdiv_(exp_avg, denom, ...)
        param[i] = p
        if bf16_out is not None:
            bf16_out[i] = f32_to_bf16_bits(p)
        m[j] = mm
        r[j] = vv
        top_m = np.uint32(max(top_m, np.float32(mm).view(np.uint32) & _ABS))
        top_v = np.uint32(max(top_v, np.float32(vv).view(np.uint32)))
    return top_m, top_v


@njit(**_INLINE)
def _saturate(m, r, length):
    """Bring a block's scratch rows into the format's range (only called when a top exceeds it): v above MOMENT_MAX
    is stored as MOMENT_MAX, and where it overflowed to inf (FP32 Adam's update of that element is 0 from then on)
    its m is stored as 0; |m| above MOMENT_MAX is stored as MOMENT_MAX. NaN stays NaN."""
    for j in range(length):
        if r[j] > MOMENT_MAX:
            if r[j] == np.inf:
                m[j] = _ZERO
            r[j] = MOMENT_MAX
        if m[j] > MOMENT_MAX:
            m[j] = MOMENT_MAX
        elif m[j] < -MOMENT_MAX:
            m[j] = -MOMENT_MAX
    return _absmax(m, length), _absmax(r, length)


@njit(**KERNEL_OPTIONS)
def adamw8_kernel(
    param,
    mq,
    vq,
    m_scale,
    v_scale,
    grads,
    bf16_out,
    segments,
    hyper,
    grad_scale,
    block,
    chunks,
):
    """Fused 8-bit AdamW: per block decode, update the segments' elements, encode with the new scales.

    ``hyper[group]`` holds the float32 scalars of :func:`cpu_ops.adamw._hyperparameters` without ``grad_scale``
    (flags as 0/1). ``bf16_out`` is None or a uint16 array (pruned at compile time). One pass over the block's
    elements in order (frozen gaps decoded, segment pieces decoded and updated); then both moments are encoded
    from the scratch rows.

    The next block's master and gradient are prefetched, half at the start of a block and half before its encode
    pass: the update has so much arithmetic per byte that, left to the out-of-order window and the hardware
    prefetchers, one core keeps too few reads in flight (measured in docs/PERFORMANCE.md: +17-21 % from memory at
    one thread on Zen 5, no change in cache; prefetching a whole block at once, or the codes and the bf16 copy too, is
    slower; into L2, see :func:`_prefetch_intrinsic`).
    """
    n = param.shape[0]
    nblocks = m_scale.shape[0]
    nseg = segments.shape[0]
    for c in prange(chunks):
        b0 = c * nblocks // chunks
        b1 = (c + 1) * nblocks // chunks
        m = np.empty(block, np.float32)
        r = np.empty(block, np.float32)
        k0 = _first_segment(segments, b0 * block)
        for b in range(b0, b1):
            s = b * block
            e = min(s + block, n)
            ahead = min(e + block, n) if b + 1 < b1 else e  # the next block of this chunk, if any
            half = min(e + block // 2, ahead)
            _prefetch_inputs(param, grads, e, half)
            scale_m = m_scale[b]
            scale_v = v_scale[b]
            top_m = np.uint32(0)
            top_v = np.uint32(0)
            while k0 < nseg and segments[k0, 1] <= s:
                k0 += 1
            k = k0
            pos = s
            while k < nseg and segments[k, 0] < e:
                first = max(segments[k, 0], s)
                last = min(segments[k, 1], e)
                if first > pos:
                    tm, tv = _decode_range(mq, vq, m, r, s, pos, first, scale_m, scale_v)
                    top_m, top_v = max(top_m, tm), max(top_v, tv)
                h = hyper[segments[k, 2]]
                decay = h[1] if h[0] != 0 else np.float32(1.0)
                weight_decay = h[3] if h[2] != 0 else np.float32(0.0)
                inv_bc2_sqrt = np.float32(1.0) / h[8]
                if h[4] != 0:  # torch's is_lerp_weight_small: one loop per branch, no select inside
                    tm, tv = _update_range(
                        param, mq, vq, m, r, grads, bf16_out, s, first, last, scale_m, scale_v, grad_scale, decay,
                        weight_decay, True, h[5], h[6], h[7], inv_bc2_sqrt, h[9], h[10],
                    )  # fmt: skip
                else:
                    tm, tv = _update_range(
                        param, mq, vq, m, r, grads, bf16_out, s, first, last, scale_m, scale_v, grad_scale, decay,
                        weight_decay, False, h[5], h[6], h[7], inv_bc2_sqrt, h[9], h[10],
                    )  # fmt: skip
                top_m, top_v = max(top_m, tm), max(top_v, tv)
                pos = last
                k += 1
            if e > pos:
                tm, tv = _decode_range(mq, vq, m, r, s, pos, e, scale_m, scale_v)
                top_m, top_v = max(top_m, tm), max(top_v, tv)
            am = np.uint32(top_m).view(np.float32)
            av = np.uint32(top_v).view(np.float32)
            if am > MOMENT_MAX or av > MOMENT_MAX:
                am, av = _saturate(m, r, e - s)
            new_m = block_scale(am)
            new_v = block_scale(av)
            inv_m = _inverse(_SQ, new_m)
            inv_v = _inverse(np.float32(1.0), new_v)
            m_scale[b] = new_m
            v_scale[b] = new_v
            _prefetch_inputs(param, grads, half, ahead)
            full = (e - s) // LANES * LANES
            for t in range(0, full, LANES):
                _encode_lanes(m, r, mq, vq, np.uint64(s + t), np.uint64(t), inv_m, inv_v)
            for t in range(full, e - s):
                i = np.uint64(s + t)
                j = np.uint64(t)
                mq[i] = encode_signed(m[j], inv_m)
                vq[i] = encode_unsigned(r[j], inv_v)


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
