"""cpu_ops.accumulate: host gradient accumulation and its squared norm, against torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_ops import accumulate, fp32_to_bf16, sum_squares


def test_accumulating_single_gradients_equals_torch_float32_sums():
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(1000).astype(np.float32) for _ in range(3)]
    acc = np.full(1000, np.nan, np.float32)
    for k, g in enumerate(grads):
        accumulate(acc, g, grad_scale=0.5, first=k == 0)
    expected = torch.zeros(1000)
    for g in grads:
        expected += torch.from_numpy(g) * 0.5
    assert torch.equal(torch.from_numpy(acc), expected)


def test_accumulating_rows_sums_them_in_order_and_reads_bf16_bits():
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((2, 500)).astype(np.float32)
    bits = np.zeros((2, 500), np.uint16)
    for r in range(2):
        fp32_to_bf16(rows[r], bits[r])
    acc = np.zeros(500, np.float32)
    accumulate(acc, bits, grad_scale=0.5, first=True)
    as_fp32 = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float()
    assert torch.equal(torch.from_numpy(acc), as_fp32[0] * 0.5 + as_fp32[1] * 0.5)


def test_sum_squares_is_a_float64_accumulation():
    x = np.full(10_000, 3e19, np.float32)  # squares overflow float32
    assert sum_squares(x) == pytest.approx(10_000 * 9e38, rel=1e-6)


def test_bad_arrays_are_refused():
    with pytest.raises(ValueError, match="length"):
        accumulate(np.zeros(4, np.float32), np.zeros(5, np.float32))
    with pytest.raises((TypeError, ValueError), match="float32"):
        sum_squares(np.zeros(4, np.float64))
