"""cpu_ops.warmup: every runtime signature is compiled up front."""

from __future__ import annotations

from typing import Any

import pytest

from cpu_ops import _kernels, warmup


def test_warmup_compiles_runtime_signatures() -> None:
    seconds = warmup(sum_rows=(2,))
    assert seconds >= 0.0
    expected = {(dtype, rows) for dtype in ("float32", "uint16") for rows in (1, 2)}
    for kernel in (_kernels.adamw_kernel, _kernels.adamw_bf16_out_kernel):
        grads: list[Any] = [sig[3] for sig in kernel.signatures]  # UniTuple of R gradient rows
        assert expected <= {(str(g.dtype.dtype), g.count) for g in grads}
    assert _kernels.fp32_to_bf16_kernel.signatures
    assert _kernels.bf16_to_fp32_kernel.signatures
    assert warmup(sum_rows=(2,)) < seconds + 1.0  # second call: nothing left to compile


def test_warmup_rejects_bad_rows() -> None:
    with pytest.raises(ValueError, match="sum_rows must be >= 1"):
        warmup(sum_rows=(0,))


def test_warmup_adam8_compiles_the_8bit_kernels() -> None:
    from cpu_ops import _kernels8

    warmup(sum_rows=(2,), adam8=True)
    expected = {(dtype, rows, out) for dtype in ("float32", "uint16") for rows in (1, 2) for out in (False, True)}
    grads: list[Any] = [(sig[5], sig[6]) for sig in _kernels8.adamw8_kernel.signatures]  # (R rows, bf16_out)
    found = {(str(g.dtype.dtype), g.count, str(out) != "none") for g, out in grads}
    assert expected <= found
    assert _kernels8.quantize_kernel.signatures
    assert _kernels8.dequantize_kernel.signatures


def test_the_module_compiles_the_signatures_it_is_asked_for(caplog: pytest.LogCaptureFixture) -> None:
    from cpu_ops.__main__ import main

    with caplog.at_level("INFO", logger="cpu_ops.warmup"):
        main(["--sum-rows", "1", "2"])
    assert "cpu_ops kernels ready" in caplog.text and "sum rows [1, 2]" in caplog.text
    assert len(_kernels.adamw_kernel.signatures) >= 3  # 1-D grads, and rows of 1 and 2 summed
    with pytest.raises(SystemExit):
        main(["--sum-rows", "x"])
