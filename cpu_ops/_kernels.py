"""Numba kernels behind :mod:`cpu_ops` (private; call the validated wrappers instead).

All kernels and the helpers they inline live in this one file on purpose: Numba's
``cache=True`` invalidates a cached kernel only when *its own* source file changes,
so a helper edited in another module would leave stale machine code behind.

Rules that keep every loop vectorized and the numerics identical to torch
(the torch reference is described in :mod:`cpu_ops.adamw`):

* ``for i in prange(n)`` over the flat index, ``error_model='numpy'``, no fastmath;
* every scalar argument is an ``np.float32`` (a Python float would turn the math
  into float64);
* bf16 <-> fp32 by bit operations on 32-bit integers (round-to-nearest-even); fp32 -> bf16 by the CPU's
  conversion instruction where Numba compiles for one that has it (AVX512-BF16), with the same results.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypedDict, cast

import llvmlite.binding
import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload


class JitOptions(TypedDict, total=False):
    """The ``numba.njit`` keyword options this module uses (typed, so ``njit(**options)`` type-checks)."""

    parallel: bool
    nogil: bool
    cache: bool
    error_model: Literal["python", "numpy"]
    inline: Literal["never", "always"]


KERNEL_OPTIONS: JitOptions = {"parallel": True, "nogil": True, "cache": True, "error_model": "numpy"}
_INLINE: JitOptions = {"inline": "always", "nogil": True, "error_model": "numpy"}

_U16 = np.uint32(16)
_RNE_BIAS = np.uint32(0x7FFF)
_ONE = np.uint32(1)
_QUIET_BIT = np.uint32(0x0040)


@intrinsic
def _fma_intrinsic(typingctx, a, b, c):
    """``a * b + c`` with a single rounding (``llvm.fma``), float32 only.

    torch's AVX2/AVX-512 CPU kernels compute ``lerp``, ``add(alpha=)`` and ``addcmul``
    with fused multiply-adds; using the same instruction keeps the moments bit-identical.
    """
    if not all(t == types.float32 for t in (a, b, c)):
        return None
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return sig, codegen


# As called from compiled code (Numba supplies ``typingctx``); numba's stub types a Python-level
# call of the intrinsic, which takes ``typingctx`` too and never returns.
_fma = cast("Callable[[np.float32, np.float32, np.float32], np.float32]", _fma_intrinsic)


@njit(**_INLINE)
def bf16_bits_to_f32(bits):
    """bf16 bits (uint16) -> float32, exact."""
    return np.uint32(np.uint32(bits) << _U16).view(np.float32)


@njit(**_INLINE)
def f32_to_bf16_bits_integer(x):
    """float32 -> bf16 bits (uint16), round-to-nearest-even; NaN -> quiet NaN (sign kept)."""
    bits = np.float32(x).view(np.uint32)
    high = np.uint32(bits >> _U16)
    rounded = np.uint32(np.uint32(bits + _RNE_BIAS + (high & _ONE)) >> _U16)
    quiet_nan = np.uint32(high | _QUIET_BIT)
    # select on the 32-bit lanes, then narrow once (narrowing both first costs AVX2 four more instructions a vector)
    return np.uint16(quiet_nan if x != x else rounded)


def _compiles_for_bf16_conversion() -> bool:
    """Whether Numba targets a CPU with AVX512-BF16 (``vcvtneps2bf16``) and llvmlite can spell LLVM's ``bfloat``.

    Numba compiles for ``NUMBA_CPU_NAME`` (else the host) with ``NUMBA_CPU_FEATURES`` (else the host's features); an
    empty feature list means the named CPU's own, which only LLVM knows: it is asked to compile one conversion."""
    if not hasattr(ir.types, "_BaseFloatType"):
        return False
    config = numba.config
    features = getattr(config, "CPU_FEATURES", None)
    if features is None:
        features = llvmlite.binding.get_host_cpu_features().flatten()
    name = getattr(config, "CPU_NAME", None)
    if name and not features:
        return _named_cpu_converts_to_bf16(name)
    return "+avx512bf16" in str(features).split(",")


def _named_cpu_converts_to_bf16(cpu: str) -> bool:
    """Whether LLVM compiles a float -> bfloat conversion for ``cpu`` (its own features) to ``vcvtneps2bf16``."""
    llvmlite.binding.initialize_native_target()
    llvmlite.binding.initialize_native_asmprinter()
    module = llvmlite.binding.parse_assembly(
        "define <8 x i16> @f(<8 x float> %x) {\n"
        "  %t = fptrunc <8 x float> %x to <8 x bfloat>\n"
        "  %b = bitcast <8 x bfloat> %t to <8 x i16>\n"
        "  ret <8 x i16> %b\n"
        "}\n"
    )
    machine = llvmlite.binding.Target.from_default_triple().create_target_machine(cpu=cpu, features="")
    return "vcvtneps2bf16" in machine.emit_assembly(module)


NATIVE_BF16 = _compiles_for_bf16_conversion()

if NATIVE_BF16:

    class _BFloat(ir.types._BaseFloatType):  # llvmlite has no bfloat type; only its name is needed
        null = "0.0"
        intrinsic_name = "bf16"

        def __str__(self) -> str:
            return "bfloat"

    _BFloat._create_instance()

    @intrinsic
    def _fptrunc_bf16_intrinsic(typingctx, x):
        """float32 -> bfloat bits (``fptrunc``: ``vcvtneps2bf16``): nearest even, NaN -> x's high half | 0x40,
        subnormal -> signed zero (the instruction flushes them; see :func:`f32_to_bf16_bits_native`)."""
        if x != types.float32:
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(builder.fptrunc(args[0], _BFloat()), ir.IntType(16))

        return types.uint16(types.float32), codegen

    _fptrunc_bf16 = cast("Callable[[np.float32], np.uint16]", _fptrunc_bf16_intrinsic)

    _EXPONENT = np.uint32(0x7F800000)
    _U23 = np.uint32(23)
    _SMALLEST_NORMAL_BF16 = np.uint16(0x0080)

    @njit(**_INLINE)
    def f32_to_bf16_bits_native(x):
        """:func:`f32_to_bf16_bits_integer` by the conversion instruction, bit for bit.

        The instruction flushes subnormal inputs to zero, so a zero or subnormal ``x`` = +-k * 2**-149 (k < 2**23)
        is converted as +-(2**-126 + k * 2**-149) (its exponent field set to 1): a normal number with the same
        fraction bits, hence the same bf16 rounding (spacing 2**-133 in both ranges, same tie parity), whose bf16 is
        0x0080 (2**-126) above x's; subtracting 0x0080 leaves x's bits (a rounding carry into 2**-125 leaves 0x0080,
        the smallest normal, as rounding x does). Four vector operations instead of about ten.
        """
        bits = np.float32(x).view(np.uint32)
        tiny = np.uint32((bits & _EXPONENT) == np.uint32(0))
        converted = _fptrunc_bf16(np.uint32(bits | (tiny << _U23)).view(np.float32))
        return np.uint16(converted - np.uint16(np.uint16(tiny) * _SMALLEST_NORMAL_BF16))

    f32_to_bf16_bits = f32_to_bf16_bits_native
else:
    f32_to_bf16_bits = f32_to_bf16_bits_integer


def as_f32(x):
    """float32 value of a gradient element: a float32, or raw bf16 bits (uint16)."""
    raise TypeError("as_f32 is only callable from Numba-compiled code")


@overload(as_f32, inline="always")
def _as_f32_overload(x):
    if x == types.float32:
        return lambda x: x
    if x == types.uint16:
        return lambda x: bf16_bits_to_f32(x)
    return None


@njit(**_INLINE)
def _summed_grad(grads, i, grad_scale):
    """sum_r(grads[r][i] * grad_scale) in float32, rows in order 0..R-1."""
    g = as_f32(grads[0][i]) * grad_scale
    for r in range(1, len(grads)):
        g = g + as_f32(grads[r][i]) * grad_scale
    return g


@njit(**_INLINE)
def _adam_element(
    p,
    m,
    v,
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
):
    """One element of torch's ``_single_tensor_adam`` (float32, same operation order)."""
    if apply_decay:  # param.mul_(1 - lr * weight_decay)
        p = p * decay
    if apply_l2:  # grad = grad.add(param, alpha=weight_decay): fmadd(param, alpha, grad)
        g = _fma(p, weight_decay, g)
    # exp_avg.lerp_(grad, w): fmadd(coeff, grad - exp_avg, base); w < 0.5: (w, exp_avg), else (w - 1, grad)
    m = _fma(lerp_coeff, g - m, m if lerp_small else g)
    # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2): v*b2 + (value*g)*g, contracted to an FMA
    v = _fma(one_minus_beta2 * g, g, v * beta2)
    # denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    denom = np.sqrt(v) / bc2_sqrt + eps
    # param.addcdiv_(exp_avg, denom, value=-step_size): p + (value * m) / denom
    p = p + (neg_step_size * m) / denom
    return p, m, v


@njit(**KERNEL_OPTIONS)
def adamw_kernel(
    param,
    exp_avg,
    exp_avg_sq,
    grads,
    grad_scale,
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
):
    """Fused Adam/AdamW step; ``grads`` is a tuple of R float32 or uint16 (bf16) rows."""
    for i in prange(param.shape[0]):
        g = _summed_grad(grads, i, grad_scale)
        p, m, v = _adam_element(
            param[i],
            exp_avg[i],
            exp_avg_sq[i],
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
        exp_avg[i] = m
        exp_avg_sq[i] = v


@njit(**KERNEL_OPTIONS)
def adamw_bf16_out_kernel(
    param,
    exp_avg,
    exp_avg_sq,
    grads,
    bf16_out,
    grad_scale,
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
):
    """:func:`adamw_kernel` that also writes the bf16 bits of the new param to ``bf16_out``."""
    for i in prange(param.shape[0]):
        g = _summed_grad(grads, i, grad_scale)
        p, m, v = _adam_element(
            param[i],
            exp_avg[i],
            exp_avg_sq[i],
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
        exp_avg[i] = m
        exp_avg_sq[i] = v
        bf16_out[i] = f32_to_bf16_bits(p)


@njit(**KERNEL_OPTIONS)
def adam_shaped_copy_kernel(param, exp_avg, exp_avg_sq, grads):
    """Moves exactly the bytes of :func:`adamw_kernel` with trivial math: that update's bandwidth ceiling."""
    one = np.float32(1.0)
    for i in prange(param.shape[0]):
        g = _summed_grad(grads, i, one)
        param[i] = param[i] - g
        exp_avg[i] = exp_avg[i] + g
        exp_avg_sq[i] = exp_avg_sq[i] + g


@njit(**KERNEL_OPTIONS)
def adam_shaped_copy_bf16_out_kernel(param, exp_avg, exp_avg_sq, grads, bf16_out):
    """Moves exactly the bytes of :func:`adamw_bf16_out_kernel` with trivial math (a truncating bf16 copy)."""
    one = np.float32(1.0)
    for i in prange(param.shape[0]):
        g = _summed_grad(grads, i, one)
        p = param[i] - g
        param[i] = p
        exp_avg[i] = exp_avg[i] + g
        exp_avg_sq[i] = exp_avg_sq[i] + g
        bf16_out[i] = np.uint16(np.float32(p).view(np.uint32) >> _U16)


@njit(**KERNEL_OPTIONS)
def fp32_to_bf16_kernel(src, dst):
    """dst[i] = bf16 bits of src[i] (round-to-nearest-even).

    By integer operations on every CPU: in a loop that only converts, LLVM vectorizes the conversion instruction
    4 lanes wide (measured 16 % slower than the integer helper, which it vectorizes 16 wide)."""
    for i in prange(src.shape[0]):
        dst[i] = f32_to_bf16_bits_integer(src[i])


@njit(**KERNEL_OPTIONS)
def bf16_to_fp32_kernel(src, dst):
    """dst[i] = float32 value of the bf16 bits src[i]."""
    for i in prange(src.shape[0]):
        dst[i] = bf16_bits_to_f32(src[i])


@njit(**KERNEL_OPTIONS)
def accumulate_kernel(acc, grads, grad_scale, first):
    """acc[i] = (0 if first else acc[i]) + sum_r(grads[r][i] * grad_scale), float32, rows in order."""
    for i in prange(acc.shape[0]):
        g = _summed_grad(grads, i, grad_scale)
        acc[i] = g if first else acc[i] + g


@njit(**KERNEL_OPTIONS)
def sum_squares_kernel(x):
    """sum(x[i]**2) accumulated in float64 (a gradient norm that cannot overflow)."""
    total = 0.0
    for i in prange(x.shape[0]):
        v = np.float64(x[i])
        total += v * v
    return total
