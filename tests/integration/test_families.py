"""Families beyond Qwen/Llama through Lightning: 2 ranks, FP32 on CPU, SlideDP equals DDP + torch.optim.AdamW
for 20 steps (per-step losses on every rank and the final weights within 1e-5 relative).

The models are ``tests.helpers.family_config``'s (the job's ``model`` option); bias-free families, since Adam
turns the one-ulp differences of a key-projection bias (whose gradient is rounding noise) into full-size ones
over 20 free-running steps (tests/models/test_adapters.py checks every family step by step).
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import BATCH, STEPS, assert_ok, compare_runs, variant_result, variants_job

pytestmark = pytest.mark.slow  # multi-process jobs

# model_type: (tied, why it is here)
FAMILIES = {
    "gemma3_text": (True, "sliding/full layers, a rotary per layer type, scaled embedding"),
    "olmoe": (False, "MoE: stacked experts, router loss"),
}
SLOW_FAMILIES = {
    "deepseek_v3": (False, "MLA, a dense and an MoE layer with a shared expert"),
    "cohere2": (True, "sliding/full layers, logit scale"),
    "mixtral": (False, "MoE with a sliding window"),
    "gemma2": (True, "attention and final-logit soft-capping, sliding/full layers"),
    "phi3": (False, "fused qkv_proj and gate_up_proj"),
    "olmo2": (False, "norms after attention and MLP, q/k norms"),
    "granite": (True, "embedding, residual and attention multipliers"),
}
CASES = [pytest.param(f, *v, id=f) for f, v in FAMILIES.items()] + [
    pytest.param(f, *v, id=f, marks=pytest.mark.slow) for f, v in SLOW_FAMILIES.items()
]


def family_jobs(job_runner, strategy: str):
    """One 2-rank job fitting every family in turn (a variant each: the start of a job, two interpreters and their
    imports, is most of a family's time)."""
    variants = {f: {"model": f, "tied": tied} for f, (tied, _) in {**FAMILIES, **SLOW_FAMILIES}.items()}
    common = dict(strategy=strategy, devices=2, tied=True, steps=STEPS, batch=BATCH)
    return variants_job(job_runner, f"families_{strategy}", variants, timeout=1800, **common)


@pytest.mark.integration
@pytest.mark.parametrize(("family", "tied", "why"), CASES)
def test_family_matches_ddp(job_runner, family: str, tied: bool, why: str) -> None:
    ref = variant_result(family_jobs(job_runner, "ddp"), family)
    assert_ok(ref)
    got = variant_result(family_jobs(job_runner, "slidedp"), family)
    assert_ok(got)
    compare_runs(ref, got, 2)
