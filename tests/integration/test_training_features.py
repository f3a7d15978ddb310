"""Trainer features with strategy="slidedp" against the DDP + torch.optim.AdamW reference: gradient clipping by
norm and by value, gradient accumulation, fp16-mixed with dynamic loss scaling, and skipped non-finite steps."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import rel_err
from tests.integration.conftest import BATCH

pytestmark = pytest.mark.slow  # multi-process jobs

STEPS = 12
RTOL = 1e-5
FEATURES = {
    # name: (Trainer / job knobs, relative tolerance on losses and weights)
    "plain": ({}, RTOL),
    "clip-norm": ({"clip": 0.05, "clip_algorithm": "norm"}, RTOL),
    "clip-value": ({"clip": 2e-3, "clip_algorithm": "value"}, RTOL),
    "accumulate2": ({"accumulate": 2}, RTOL),
    "accumulate4": ({"accumulate": 4}, RTOL),
    "accumulate2-clip-norm": ({"accumulate": 2, "clip": 0.05}, RTOL),
    "fp16-mixed": ({"precision": "16-mixed"}, 2e-2),
}


def run_features(job_runner, strategy: str, features=FEATURES, **extra):
    variants = {name: knobs for name, (knobs, _) in FEATURES.items() if name in features}
    res = job_runner(
        f"features_{strategy}" + "".join(f"_{k}{v}" for k, v in extra.items()),
        strategy=strategy,
        devices=2,
        tied=False,
        steps=STEPS,
        batch=BATCH,
        variants=variants,
        timeout=900,
        **extra,
    )
    assert res.returncode == 0, res.output[-4000:]
    return res


@pytest.mark.integration
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_feature_matches_ddp(job_runner, feature):
    ref = run_features(job_runner, "ddp")
    got = run_features(job_runner, "slidedp", grad_route="host_reduce", chunk_bytes=4096)
    rtol = FEATURES[feature][1]
    state = assert_feature_matches(ref, got, feature, rtol, 1e-1 if rtol != RTOL else rtol)
    if "clip" in feature:  # the clip binds: the result is not the unclipped one
        plain = matrix_result_any(got, "accumulate2" if "accumulate" in feature else "plain")[1]
        assert max(rel_err(state[k], plain[k], floor=1e-12) for k in state) > 1e-3, "the clip threshold did not bind"


def assert_feature_matches(ref, got, feature: str, rtol: float, weights_rtol: float) -> dict:
    """Per-step losses of both ranks and the final weights of ``feature`` in ``got`` against ``ref``; returns
    ``got``'s weights."""
    (ref_losses, ref_state), (losses, state) = matrix_result_any(ref, feature), matrix_result_any(got, feature)
    for r in range(2):
        assert len(losses[r]) == len(ref_losses[r]) > 0
        worst = max(abs(x - y) / abs(y) for x, y in zip(losses[r], ref_losses[r]))
        assert worst <= rtol, f"{feature}, rank {r}: per-step loss differs by {worst:.2e} relative"
    for k in ref_state:
        assert rel_err(state[k], ref_state[k], floor=1e-12) <= weights_rtol, (feature, k)
    return state


def matrix_result_any(res, variant: str):
    """Losses per rank (every micro-batch) and final weights of one variant (any number of steps)."""
    import json

    out = res.out / variant
    losses = [json.loads((out / f"losses_rank{r}.json").read_text()) for r in range(2)]
    return losses, torch.load(out / "final_state.pt")


@pytest.mark.integration
def test_accumulation_and_clipping_with_moments_on_disk_match_ddp(job_runner):
    """The moments in a state file on disk: accumulated and clipped steps equal the DDP reference, as in memory."""
    features = ("plain", "accumulate2-clip-norm", "clip-value")
    ref = run_features(job_runner, "ddp")
    got = run_features(job_runner, "slidedp", features, grad_route="host_reduce", chunk_bytes=4096, state_on_disk=True)
    for feature in features:
        assert_feature_matches(ref, got, feature, RTOL, RTOL)


@pytest.mark.integration
def test_a_non_finite_gradient_on_one_rank_skips_that_step_everywhere(job_runner):
    """update="deferred": a NaN in rank 0's loss at batch 3 leaves the ledger as if batch 3 had not been there."""
    common = dict(
        strategy="slidedp",
        devices=2,
        tied=True,
        steps=8,
        data_batches=8,
        batch=BATCH,
        update="deferred",
        constant_lr=True,
        distributed_sampler=False,
    )
    # the NaN run takes 8 optimizer steps of which one is skipped; the other run never sees that batch
    variants = {"nan": {"nan_at_step": 3}, "skipped": {"drop_batch": 3, "steps": 7}}
    res = job_runner("nonfinite", variants=variants, timeout=600, **common)
    assert res.returncode == 0, res.output[-4000:]
    assert res.output.count("non-finite gradient") >= 1
    nan, skipped = matrix_result_any(res, "nan"), matrix_result_any(res, "skipped")
    assert all(torch.equal(nan[1][k], skipped[1][k]) for k in nan[1]), "weights differ from the skipped-batch run"
