"""cpu_ops.convert against torch's bf16 conversions."""

from __future__ import annotations

import os
import subprocess
import sys

import numba
import numpy as np
import pytest
import torch

from cpu_ops import _kernels, bf16_to_fp32, fp32_to_bf16, is_vectorized

SPECIAL_BITS = [
    0x00000000,
    0x80000000,  # +-0
    0x3F800000,
    0x3F800001,
    0x3F807FFF,  # 1 and values just above it
    0x3F808000,
    0x3F818000,
    0xBF808000,
    0xBF818000,  # ties: to even (down, up), both signs
    0x3F808001,
    0x3F817FFF,  # just above / below a tie
    0x7F7FFFFF,
    0xFF7FFFFF,  # max finite rounds to +-inf
    0x7F800000,
    0xFF800000,  # +-inf
    0x00000001,
    0x00008000,
    0x00018000,
    0x00007FFF,
    0x007FFFFF,
    0x807FFFFF,  # subnormals
    0x00800000,
    0x80800000,  # smallest normals
]
NAN_BITS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FA00000, 0xFFBFFFFF, 0x7FFFFFFF]


def torch_bf16_bits(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def to_bf16(x: np.ndarray) -> np.ndarray:
    out = np.empty(x.shape[0], np.uint16)
    fp32_to_bf16(x, out)
    return out


def test_fp32_to_bf16_special_values_match_torch() -> None:
    bits = np.array(SPECIAL_BITS * 3, np.uint32)  # long enough for the vector loop and a tail
    x = bits.view(np.float32)
    np.testing.assert_array_equal(to_bf16(x), torch_bf16_bits(x))


def test_fp32_to_bf16_random_values_match_torch() -> None:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=200_003, dtype=np.uint32)
    x = bits.view(np.float32)
    finite = ~np.isnan(x)
    ours = to_bf16(x)
    np.testing.assert_array_equal(ours[finite], torch_bf16_bits(x)[finite])


def test_fp32_to_bf16_nan_stays_quiet_nan() -> None:
    x = np.array(NAN_BITS * 4, np.uint32).view(np.float32)
    out = to_bf16(x)
    assert np.all((out & 0x7F80) == 0x7F80), "exponent must stay all ones"
    assert np.all(out & 0x0040), "NaN must come out quiet"
    np.testing.assert_array_equal(out >> 15, np.array(NAN_BITS * 4, np.uint32) >> 31)  # sign kept
    back = np.empty(x.shape[0], np.float32)
    bf16_to_fp32(out, back)
    assert np.isnan(back).all()


def test_bf16_to_fp32_all_patterns_exact() -> None:
    bits = np.arange(2**16, dtype=np.uint16)
    ours = np.empty(bits.shape[0], np.float32)
    bf16_to_fp32(bits, ours)
    ref = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))
    # round trip is the identity on every non-NaN pattern
    finite = ~np.isnan(ours)
    np.testing.assert_array_equal(to_bf16(ours)[finite], bits[finite])


@pytest.mark.parametrize("kernel", ["fp32_to_bf16", "bf16_to_fp32"])
def test_conversions_vectorized(kernel: str) -> None:
    assert is_vectorized(kernel)


@pytest.mark.parametrize(
    ("func", "src", "dst", "exc", "match"),
    [
        (fp32_to_bf16, np.zeros(4, np.float64), np.zeros(4, np.uint16), TypeError, "src must have dtype float32"),
        (
            fp32_to_bf16,
            np.zeros(4, np.float32),
            np.zeros(4, np.int16),
            TypeError,
            r"dst must have dtype uint16.*view\(np.uint16\)",
        ),
        (fp32_to_bf16, np.zeros(4, np.float32), np.zeros(5, np.uint16), ValueError, "dst has length 5, expected 4"),
        (bf16_to_fp32, np.zeros(8, np.uint16)[::2], np.zeros(4, np.float32), ValueError, "src must be contiguous"),
        (bf16_to_fp32, np.zeros(4, np.uint16), np.zeros(4, np.float16), TypeError, "dst must have dtype float32"),
    ],
)
def test_bad_input(func, src, dst, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        func(src, dst)


def test_widen_bf16_writes_torchs_fp32_values_and_bf16_bits_counting_nans() -> None:
    from cpu_ops import widen_bf16

    rng = np.random.default_rng(3)
    specials = [0x0000, 0x8000, 0x3F80, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x0080]
    nans = [0x7FC0, 0xFFC0, 0x7F81, 0xFFFF]
    src = np.concatenate([np.array(specials + nans, np.uint16), rng.integers(0, 1 << 16, 10_000).astype(np.uint16)])
    src_t = torch.from_numpy(src.view(np.int16)).view(torch.bfloat16)
    master, bf16 = np.full(src.shape, 7, np.float32), np.full(src.shape, 7, np.uint16)
    count = widen_bf16(src, master, bf16)
    expected = src_t.float()
    assert np.array_equal(master.view(np.uint32), expected.numpy().view(np.uint32))  # bits, NaN payloads too
    is_nan = np.isnan(master)
    assert count == int(is_nan.sum()) >= len(nans)
    torch_bits = torch_bf16_bits(expected.numpy())
    assert np.array_equal(bf16[~is_nan], torch_bits[~is_nan])  # what bf16.copy_(master) writes
    assert np.array_equal(bf16, src)


def test_widen_bf16_refuses_mismatched_or_read_only_arrays() -> None:
    from cpu_ops import widen_bf16

    src = np.zeros(8, np.uint16)
    with pytest.raises(ValueError, match="length"):
        widen_bf16(src, np.zeros(7, np.float32), np.zeros(8, np.uint16))
    with pytest.raises(TypeError, match="dtype"):
        widen_bf16(src, np.zeros(8, np.float64), np.zeros(8, np.uint16))
    read_only = np.zeros(8, np.uint16)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        widen_bf16(src, np.zeros(8, np.float32), read_only)


def _converter(helper):  # type: ignore[no-untyped-def]
    @numba.njit(parallel=True, error_model="numpy")
    def convert(x, out):  # type: ignore[no-untyped-def]
        for i in numba.prange(x.shape[0]):
            out[i] = helper(x[i])

    return convert


@pytest.mark.skipif(not _kernels.NATIVE_BF16, reason="Numba does not compile for a CPU with AVX512-BF16 here")
def test_native_bf16_conversion_equals_the_integer_one_bit_for_bit() -> None:
    """The instruction flushes subnormals to zero; the native helper must not: every subnormal of both signs, the
    special values, NaNs and random bit patterns give the integer helper's bits."""
    assert _kernels.f32_to_bf16_bits is _kernels.f32_to_bf16_bits_native
    subnormals = np.arange(1, 1 << 23, dtype=np.uint32)
    rng = np.random.default_rng(1)
    bits = np.concatenate(
        [
            np.array(SPECIAL_BITS + NAN_BITS, np.uint32),
            subnormals,
            subnormals | np.uint32(0x80000000),
            rng.integers(0, 2**32, size=1 << 22, dtype=np.uint32),
        ]
    )
    x = bits.view(np.float32)
    native = np.empty(x.shape[0], np.uint16)
    integer = np.empty(x.shape[0], np.uint16)
    native_kernel = _converter(_kernels.f32_to_bf16_bits_native)
    native_kernel(x, native)
    _converter(_kernels.f32_to_bf16_bits_integer)(x, integer)
    differ = np.flatnonzero(native != integer)
    assert differ.size == 0, [(hex(bits[i]), hex(native[i]), hex(integer[i])) for i in differ[:5]]
    assert "vcvtneps2bf16" in native_kernel.inspect_asm(native_kernel.signatures[0])


@pytest.mark.parametrize(
    ("cpu", "features", "native"),
    [
        ("generic", "", False),
        ("znver4", "+avx512f,+avx512bf16", True),
        ("znver4", "-avx512bf16", False),
        ("cooperlake", "", True),  # the named CPU's own features: LLVM's list has AVX512-BF16
        ("skylake-avx512", "", False),
        ("haswell", "", False),
    ],
)
def test_the_conversion_instruction_is_used_only_where_numba_targets_it(cpu: str, features: str, native: bool) -> None:
    """NUMBA_CPU_NAME / NUMBA_CPU_FEATURES (a portable cache) decide, not the host."""
    env = {**os.environ, "NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": features}
    code = "from cpu_ops import _kernels; print(_kernels.NATIVE_BF16)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == str(native)
