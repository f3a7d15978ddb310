"""The model against the paper's figures (arXiv 2609.34162), with the shipped profiles.

Which checks are predictions: see docs/STEPTIME.md. The H100 efficiency is fitted to 23 200 tokens/s and
the A800 no-bridge collective rate to the batch-16 no-bridge margin; neither figure is asserted as a check.
"""

import pytest

from slidedp_lightning.steptime import StepConfig, UnitActivation, load_config, load_profile, simulate
from slidedp_lightning.steptime.microbench import chunked_grad_path, chunked_param_path
from slidedp_lightning.steptime.workload import units

SEQ = 1024
GLOBAL_BATCH = 64  # per-GPU 16 at R=4 and 8 at R=8: the per-GPU batches of the route table


@pytest.fixture(scope="module")
def qwen14():
    return load_config("qwen3-14b")


@pytest.mark.xfail(
    strict=True,
    reason="the model predicts the replicated step grows ~1.7x from 4 to 8 GPUs "
    "(update x R on a fixed host); the paper measures it flat (docs/STEPTIME.md)",
)
def test_replicated_baseline_is_flat_from_4_to_8(qwen14):
    p = load_profile("a800x8_bridge")
    t = {
        r: simulate(StepConfig(qwen14, GLOBAL_BATCH // r, SEQ, r, "replicated", activation="full"), p).step_time
        for r in (4, 8)
    }
    assert 0.9 <= t[8] / t[4] <= 1.1


@pytest.mark.xfail(
    strict=True,
    reason="SlideFormer's multi-GPU form as its public code runs it (full upload per "
    "rank on one transfer thread; rank 0 alone sums the R BF16 slots through FP32 temporaries and runs "
    "Adam, between two barriers per chunk) grows ~1.8x from 4 to 8 GPUs (1.5x-2.9x under the other "
    "thread budgets tried); the paper measures it flat at ~43 s (docs/STEPTIME.md)",
)
def test_slideformer_baseline_is_flat_from_4_to_8(qwen14):
    """The paper's replicated baseline is SlideFormer's multi-GPU form, not this runtime's replicated route."""
    p = load_profile("a800x8_bridge")
    t = {
        r: simulate(
            StepConfig(qwen14, GLOBAL_BATCH // r, SEQ, r, "slideformer", "host_reduce", activation="full"), p
        ).step_time
        for r in (4, 8)
    }
    assert 0.9 <= t[8] / t[4] <= 1.1


def margin(qwen14, profile: str, batch: int) -> tuple[str, float]:
    """Winner and its step-time saving 1 - T_winner / T_loser, R=8, gpu_reduce, full recompute."""
    p = load_profile(profile)
    t = {
        route: simulate(StepConfig(qwen14, batch, SEQ, 8, route, activation="full"), p).step_time
        for route in ("full", "sharded")
    }
    win, lose = sorted(t, key=t.get)
    return win, 1 - t[win] / t[lose]


@pytest.mark.parametrize(
    ("profile", "batch", "winner", "paper"),
    [
        ("a800x8_bridge", 16, "sharded", 0.17),
        ("a800x8_bridge", 8, "sharded", 0.33),
        ("a800x8_nobridge", 8, "full", 0.19),
    ],
)
def test_route_choice_predicted(qwen14, profile, batch, winner, paper):
    win, m = margin(qwen14, profile, batch)
    assert win == winner
    assert abs(m - paper) <= 0.10


def test_route_choice_fitted_case(qwen14):
    """Batch 16 without bridge: the collective rate was fitted here, so only the winner is a check."""
    win, m = margin(qwen14, "a800x8_nobridge", 16)
    assert win == "full" and m == pytest.approx(0.26, abs=0.02)


def test_chunked_overlap_microbenchmark(qwen14):
    p = load_profile("a800x8_bridge")
    n = qwen14.layer_params
    assert chunked_param_path(0.1278, n, p) == pytest.approx(0.0508, rel=0.15)
    assert chunked_grad_path(0.1359, n, p) == pytest.approx(0.0917, rel=0.15)


def _h100_batch256(qwen14):
    # full recompute, layer inputs offloaded to the host (they do not fit next to the weights otherwise)
    act = UnitActivation(1.0, qwen14.hidden * 2, 1.0)
    return StepConfig(qwen14, 256, SEQ, 4, "sharded", activation=act)


def test_h100_batch256_hides_all_host_work(qwen14):
    r = simulate(_h100_batch256(qwen14), load_profile("h100x8"))
    assert r.bottleneck == "gpu-bound"
    host = sum(v for k, v in r.busy.items() if k != "compute")
    assert host > 1.0  # seconds of host work exist...
    assert sum(r.exposed.values()) < 0.01 * r.step_time  # ...and less than 1 % of the step waits on it


def test_h100_efficiency_fit(qwen14):
    """The fitted constant is what 23 200 tokens/s implies for the FLOPs of this workload (a consistency check)."""
    cfg = _h100_batch256(qwen14)
    flops = sum(
        u.fwd_flops_per_token * (1 + 2 + u.activation.recompute_fraction) for u in units(qwen14, SEQ, cfg.activation)
    )
    p = load_profile("h100x8")
    assert p.gpu_efficiency == pytest.approx(23200 / 4 * flops / p.gpu_flops, abs=0.001)
