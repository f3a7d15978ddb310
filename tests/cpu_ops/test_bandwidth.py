"""The bandwidth-ceiling kernels touch exactly the arrays an update touches (so their bytes/param are honest)."""

from __future__ import annotations

import numpy as np
import pytest

from cpu_ops import QUANT_BLOCK, adam8_shaped_copy, adam_shaped_copy, fp32_to_bf16
from slidedp_lightning.constants import update_bytes_per_param


def _state(n: int):
    rng = np.random.default_rng(1)
    p = rng.standard_normal(n, dtype=np.float32)
    m = rng.standard_normal(n, dtype=np.float32)
    v = rng.random(n, dtype=np.float32)
    return p, m, v


@pytest.mark.parametrize("grad_dtype", [np.float32, np.uint16])
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("with_out", [False, True])
def test_adam_shaped_copy_reads_every_row_and_writes_every_output(grad_dtype, rows, with_out):
    n = 5000
    p, m, v = _state(n)
    g32 = np.random.default_rng(2).standard_normal((rows, n), dtype=np.float32)
    if grad_dtype is np.uint16:
        grads = np.empty((rows, n), np.uint16)
        for r in range(rows):
            fp32_to_bf16(g32[r], grads[r])
        g32 = (grads.astype(np.uint32) << 16).view(np.float32)
    else:
        grads = g32
    total = g32[0].copy()
    for r in range(1, rows):
        total = total + g32[r]
    p0, m0, v0 = p.copy(), m.copy(), v.copy()
    out = np.zeros(n, np.uint16) if with_out else None
    adam_shaped_copy(p, m, v, grads[0] if rows == 1 else grads, out)
    np.testing.assert_array_equal(p, p0 - total)
    np.testing.assert_array_equal(m, m0 + total)
    np.testing.assert_array_equal(v, v0 + total)
    if with_out:
        np.testing.assert_array_equal(out, (p.view(np.uint32) >> 16).astype(np.uint16))


def test_update_bytes_per_param_conventions():
    assert update_bytes_per_param(4) == 28  # fp32 AdamW: read p, g, m, v; write p, m, v
    assert update_bytes_per_param(2, bf16_out=True) == 28  # bf16 grad in, bf16 copy out
    assert update_bytes_per_param(2, rows=4, bf16_out=True) == 34  # host_reduce over 4 bf16 slots


def test_adam_shaped_copy_rejects_mismatched_rows():
    p, m, v = _state(100)
    with pytest.raises(ValueError, match="grads"):
        adam_shaped_copy(p, m, v, np.zeros((2, 99), np.float32))


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("with_out", [False, True])
def test_adam8_shaped_copy_touches_every_array_of_the_8bit_update(rows, with_out):
    n = 3 * QUANT_BLOCK + 5
    nblocks = 4
    rng = np.random.default_rng(3)
    p = rng.standard_normal(n, dtype=np.float32)
    mq, vq = rng.integers(0, 256, n).astype(np.uint8), rng.integers(0, 256, n).astype(np.uint8)
    m_absmax, v_absmax = rng.random(nblocks, dtype=np.float32), rng.random(nblocks, dtype=np.float32)
    grads = rng.standard_normal((rows, n), dtype=np.float32)
    before = [a.copy() for a in (p, mq, vq, m_absmax, v_absmax)]
    out = np.zeros(n, np.uint16) if with_out else None
    adam8_shaped_copy(p, mq, vq, m_absmax, v_absmax, grads[0] if rows == 1 else grads, out)
    np.testing.assert_array_equal(
        p, before[0] - grads.sum(axis=0, dtype=np.float32) if rows > 1 else before[0] - grads[0]
    )
    np.testing.assert_array_equal(mq, before[1] + np.uint8(1))
    np.testing.assert_array_equal(vq, before[2] + np.uint8(1))
    np.testing.assert_array_equal(m_absmax, before[3] + np.float32(1))
    np.testing.assert_array_equal(v_absmax, before[4] + np.float32(1))
    if with_out:
        np.testing.assert_array_equal(out, (p.view(np.uint32) >> 16).astype(np.uint16))


def test_adam8_shaped_copy_rejects_wrong_scales():
    n = 2 * QUANT_BLOCK
    with pytest.raises(ValueError, match="exp_avg_absmax has length 3"):
        adam8_shaped_copy(
            np.zeros(n, np.float32), np.zeros(n, np.uint8), np.zeros(n, np.uint8), np.zeros(3, np.float32),
            np.zeros(2, np.float32), np.zeros(n, np.float32),
        )  # fmt: skip
