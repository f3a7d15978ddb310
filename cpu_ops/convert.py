"""fp32 <-> bf16 conversion of flat numpy arrays (bf16 held as raw uint16 bits)."""

from __future__ import annotations

import numpy as np

from cpu_ops import _kernels
from cpu_ops._validate import BF16_BITS, FP32, check_vector

__all__ = ["fp32_to_bf16", "bf16_to_fp32"]


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
