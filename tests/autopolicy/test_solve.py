"""autopolicy.solve: the integer program finds the true optimum of the linearized model, or says why not."""

from __future__ import annotations

import itertools
import random

import pytest

from slidedp_lightning.autopolicy.solve import Fixed, Option, predict, solve


def brute_force(blocks, options, fixed, budget):
    best = None
    for combo in itertools.product(options, repeat=len(blocks)):
        if sum(o.retained_bytes for o in combo) <= budget:
            t = predict(list(combo), fixed)["step"]
            best = t if best is None else min(best, t)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_program_finds_the_exhaustive_optimum(seed):
    rng = random.Random(seed)
    options = [Option(f"o{k}", rng.uniform(1, 5), rng.randint(1, 100), rng.randint(0, 50)) for k in range(4)]
    blocks = [f"layers.{i}" for i in range(3)]
    fixed = Fixed(
        gpu=rng.uniform(0, 2),
        h2d=rng.uniform(0, 8),
        d2h=rng.uniform(0, 8),
        host=rng.uniform(0, 10),
        h2d_rate=rng.uniform(5, 50),
        d2h_rate=rng.uniform(5, 50),
    )
    budget = rng.randint(min(o.retained_bytes for o in options) * 3, 300)
    choice = solve(blocks, options, fixed, budget)
    assert len(choice) == 3
    assert sum(o.retained_bytes for o in choice) <= budget
    assert predict(choice, fixed)["step"] == pytest.approx(brute_force(blocks, options, fixed, budget), rel=1e-6)


def test_a_tight_budget_mixes_options_across_blocks():
    fast_big, slow_small = Option("none@0", 1.0, 100, 0), Option("full@0", 1.5, 10, 0)
    choice = solve([f"layers.{i}" for i in range(4)], [fast_big, slow_small], Fixed(), budget=230)
    assert sorted(o.policy for o in choice) == ["full@0", "full@0", "none@0", "none@0"]


def test_offload_is_chosen_only_when_the_links_have_room():
    kept, moved = Option("none@0", 1.0, 100, 0), Option("none@1", 1.0, 0, 100)
    blocks = ["layers.0", "layers.1"]
    # links idle: moving activations costs nothing the step waits for, and frees the budget
    assert [o.policy for o in solve(blocks, [kept, moved], Fixed(h2d_rate=1000, d2h_rate=1000), budget=100)].count(
        "none@1"
    ) >= 1
    # links already the bottleneck: keep everything on the device when the budget allows it
    busy = Fixed(h2d=5.0, h2d_rate=10, d2h_rate=10)
    assert [o.policy for o in solve(blocks, [kept, moved], busy, budget=200)] == ["none@0", "none@0"]


def test_an_impossible_budget_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match="no activation policy fits"):
        solve(["layers.0", "layers.1"], [Option("full@0", 1.0, 1 << 20, 0)], Fixed(), budget=1 << 20)


def test_a_tight_budget_with_busy_links_picks_full_checkpointing_with_offload():
    # per-block costs shaped like a measured decoder block: recompute costs time, offload costs link time
    measured = {
        "none": (2.4, 191_488),
        "selective": (3.6, 90_112),
        "segments:1111111": (3.3, 106_496),
        "segments:1010101": (3.1, 57_344),
        "full": (3.2, 8_192),
    }
    options = [
        Option(f"{m}@{r:g}", t, round(b * (1 - r)), round(b * r))
        for m, (t, b) in measured.items()
        for r in (0.0, 0.5, 1.0)
    ]
    blocks = [f"layers.{i}" for i in range(8)]
    busy = Fixed(
        gpu=1.0, h2d=30.0, d2h=30.0, host=5.0, h2d_rate=2e5, d2h_rate=2e5
    )  # parameter traffic: the links bound the step
    ample = solve(blocks, options, busy, budget=10**9)
    assert {o.policy for o in ample} == {"none@0"}
    tight = solve(blocks, options, busy, budget=8 * 4_096)
    assert {o.policy.split("@")[0] for o in tight} == {"full"}
    assert sum(o.offloaded_bytes for o in tight) > 0 and sum(o.retained_bytes for o in tight) <= 8 * 4_096


def test_no_budget_means_no_memory_constraint():
    options = [Option("none@0", 1.0, 10**12, 0), Option("full@0", 1.5, 10, 0)]
    assert [o.policy for o in solve(["layers.0"], options, Fixed(), budget=float("inf"))] == ["none@0"]
