"""bf16-mixed: units stream as the ledger's BF16 copy; losses track the FP32 reference and fall."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # two 2-rank jobs of 50 steps

STEPS = 50


@pytest.mark.integration
def test_bf16_mixed_tracks_fp32_reference(job_runner):
    common = dict(devices=2, tied=True, steps=STEPS, batch=4)
    ref = job_runner("ref_ddp_fp32_50", strategy="ddp", **common)
    got = job_runner("slidedp_bf16_50", strategy="slidedp", precision="bf16-mixed", **common)
    assert ref.returncode == 0, ref.output[-4000:]
    assert got.returncode == 0, got.output[-4000:]
    for rank in range(2):
        a, b = ref.losses(rank), got.losses(rank)
        assert len(a) == len(b) == STEPS
        worst = max(abs(x - y) for x, y in zip(a, b))
        assert worst <= 2e-2, f"rank {rank}: bf16 loss differs from FP32 by {worst:.4f}"
        first, last = sum(b[:5]) / 5, sum(b[-5:]) / 5
        assert last < 0.8 * first, f"rank {rank}: loss did not fall ({first:.3f} -> {last:.3f})"
