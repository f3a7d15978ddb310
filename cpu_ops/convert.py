"""fp32 <-> bf16 conversion of flat numpy arrays (bf16 held as raw uint16 bits)."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from cpu_ops import _kernels
from cpu_ops._validate import BF16_BITS, FP32, check_vector

__all__ = ["fp32_to_bf16", "bf16_to_fp32", "widen_bf16"]


def fp32_to_bf16(src: np.ndarray, dst: np.ndarray) -> None:
    """Write the bf16 bits of float32 ``src`` into uint16 ``dst`` (1-D, contiguous, same length).

    Round-to-nearest-even like torch; inf stays inf, subnormals are rounded (not flushed),
    NaN becomes a quiet NaN with its sign and top payload bits kept.
    """
    check_vector("src", src, None, (FP32,))
    check_vector("dst", dst, src.shape[0], (BF16_BITS,), writeable=True)
    _kernels.fp32_to_bf16_kernel(src, dst)


def bf16_to_fp32(src: np.ndarray, dst: np.ndarray) -> None:
    """Write the float32 values of the bf16 bits in uint16 ``src`` into ``dst`` (exact)."""
    check_vector("src", src, None, (BF16_BITS,))
    check_vector("dst", dst, src.shape[0], (FP32,), writeable=True)
    _kernels.bf16_to_fp32_kernel(src, dst)


# Kept here rather than in _kernels: it is self-contained (no inlined helper from another module), so Numba's
# per-file cache stays valid.
@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def _widen_bf16_kernel(src, master, bf16):  # pragma: no cover - compiled
    nans = 0
    for i in prange(src.shape[0]):
        bits = src[i]
        master[i] = np.uint32(bits) << np.uint32(16)
        bf16[i] = bits
        if (bits & np.uint16(0x7FFF)) > np.uint16(0x7F80):
            nans += 1
    return nans


def widen_bf16(src: np.ndarray, master: np.ndarray, bf16: np.ndarray) -> int:
    """One pass over the bf16 bits ``src`` (uint16): their float32 values into ``master`` (viewed as uint32 or
    float32, exact) and the same bits into ``bf16`` (uint16), what rounding the float32 values back to bf16 gives
    for every value but NaN. Returns the number of NaNs in ``src`` (their bf16 bits are copied as they are, which
    a conversion from float32 may canonicalize: the caller rewrites those if it needs its converter's bits)."""
    check_vector("src", src, None, (BF16_BITS,))
    check_vector("master", master, src.shape[0], (FP32, np.dtype(np.uint32)), writeable=True)
    check_vector("bf16", bf16, src.shape[0], (BF16_BITS,), writeable=True)
    return int(_widen_bf16_kernel(src, master.view(np.uint32), bf16))
