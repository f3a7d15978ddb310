"""Cheap argument checks shared by the kernel wrappers (shapes, dtypes and flags only)."""

from __future__ import annotations

import numpy as np

FP32 = np.dtype(np.float32)
BF16_BITS = np.dtype(np.uint16)


def _dtype_names(dtypes: tuple[np.dtype, ...]) -> str:
    return " or ".join(str(d) for d in dtypes)


def check_array(
    name: str, a: object, dtypes: tuple[np.dtype, ...], ndim: int = 1, writeable: bool = False
) -> np.ndarray:
    """Check type, dtype and rank of ``a``; return it."""
    if not isinstance(a, np.ndarray):
        raise TypeError(
            f"{name} must be a numpy.ndarray, got {type(a).__name__}; "
            "pass tensor.numpy() (bf16 tensors as tensor.view(torch.uint16).numpy())"
        )
    if a.dtype not in dtypes:
        hint = " (raw bf16 bits: use arr.view(np.uint16))" if BF16_BITS in dtypes else ""
        raise TypeError(f"{name} must have dtype {_dtype_names(dtypes)}, got {a.dtype}{hint}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    if writeable and not a.flags.writeable:
        raise ValueError(f"{name} is read-only; it is written in place, pass a writeable array")
    return a


def check_vector(
    name: str, a: object, n: int | None, dtypes: tuple[np.dtype, ...], writeable: bool = False
) -> np.ndarray:
    """Check that ``a`` is a C-contiguous 1-D array of one of ``dtypes`` and length ``n``."""
    arr = check_array(name, a, dtypes, 1, writeable)
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"{name} has length {arr.shape[0]}, expected {n} (all arrays must match)")
    if not arr.flags.c_contiguous:
        raise ValueError(
            f"{name} must be contiguous (got strides {arr.strides}); pass a flat view of the "
            "buffer or split the update into contiguous chunks"
        )
    return arr
