"""Resuming from a distributed checkpoint on 2 CPU ranks (FP32): the 20 steps after the resume equal DDP +
torch.optim.AdamW resumed from its own checkpoint of the same step (both started from the same weights, so the
saved states agree as test_equivalence shows), per-step losses and final weights within 1e-5 relative; the
ranks' private memory while the resumed run fills its ledger stays within the bound of a fresh start."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import BATCH

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # multi-process jobs

SAVE_AT, STEPS = 5, 25  # 20 steps after the resume
RTOL = 1e-5
COMMON = dict(devices=2, tied=False, batch=BATCH, steps=STEPS)
# private memory a resume may add over a fresh start, summed over the ranks: max(300 MB, 25 % of one FP32 model)
BOUND = 300e6


def _ok(res):
    assert res.returncode == 0, res.output[-4000:]
    return res


def _relative(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _anon_peak_sum(res, ranks: int = 2) -> int:
    return sum(json.loads((res.out / f"memory_rank{r}.json").read_text())["anon_peak"] for r in range(ranks))


def test_a_resume_from_a_distributed_checkpoint_equals_ddp_resumed_from_the_same_step(job_runner) -> None:
    slide_first = _ok(job_runner("resume_slidedp_first", strategy="slidedp", save_at=SAVE_AT, **COMMON))
    ddp_first = _ok(job_runner("resume_ddp_first", strategy="ddp", save_at=SAVE_AT, **COMMON))
    assert (slide_first.out / "ck").is_dir() and (ddp_first.out / "ck").is_file()  # DCP directory; Lightning file
    slide = _ok(
        job_runner(
            "resume_slidedp",
            strategy="slidedp",
            ckpt_path=str(slide_first.out / "ck"),
            record_memory=True,
            **COMMON,
        )
    )
    ddp = _ok(job_runner("resume_ddp", strategy="ddp", ckpt_path=str(ddp_first.out / "ck"), **COMMON))
    for rank in range(2):
        a, b = ddp.losses(rank), slide.losses(rank)
        assert len(a) == len(b) == STEPS - SAVE_AT
        worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
        assert worst <= RTOL, f"rank {rank}: per-step loss after the resume differs by {worst:.2e} relative"
    ref, got = ddp.state(), slide.state()
    assert sorted(ref) == sorted(got)
    for name in ref:
        assert _relative(got[name], ref[name]) <= RTOL, name
    fresh = _ok(job_runner("resume_fresh_start", strategy="slidedp", record_memory=True, **{**COMMON, "steps": 1}))
    extra = _anon_peak_sum(slide) - _anon_peak_sum(fresh)
    assert extra <= BOUND, f"the resume held {extra / 1e6:.0f} MB more private memory than a fresh start"
