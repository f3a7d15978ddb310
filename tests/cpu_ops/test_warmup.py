"""cpu_ops.warmup: every runtime signature is compiled up front."""

from __future__ import annotations

import pytest

from cpu_ops import _kernels, warmup


def test_warmup_compiles_runtime_signatures() -> None:
    seconds = warmup(sum_rows=(2,))
    assert seconds >= 0.0
    expected = {(dtype, rows) for dtype in ("float32", "uint16") for rows in (1, 2)}
    for kernel in (_kernels.adamw_kernel, _kernels.adamw_bf16_out_kernel):
        grads = [sig[3] for sig in kernel.signatures]  # UniTuple of R gradient rows
        assert expected <= {(str(g.dtype.dtype), g.count) for g in grads}
    assert _kernels.fp32_to_bf16_kernel.signatures
    assert _kernels.bf16_to_fp32_kernel.signatures
    assert warmup(sum_rows=(2,)) < seconds + 1.0  # second call: nothing left to compile


def test_warmup_rejects_bad_rows() -> None:
    with pytest.raises(ValueError, match="sum_rows must be >= 1"):
        warmup(sum_rows=(0,))
