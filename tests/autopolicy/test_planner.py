"""AutoPolicy on a one-process engine: it measures, solves within the budget, saves a reusable plan, and the
training it plans stays bit-identical."""

from __future__ import annotations

import json

import pytest
import torch

from slidedp_lightning.autopolicy import AutoPolicy
from slidedp_lightning.autopolicy.solve import Fixed, Option, predict
from slidedp_lightning.runtime.activation_policy import ActivationPolicy
from slidedp_lightning.runtime.engine import EngineConfig, SlideDPEngine
from tests.helpers import tiny_model
from tests.runtime.helpers import CPU, adamw_groups, batches, loss_of, train

STEPS = 3


def run(planner: AutoPolicy, policy=None):
    model = tiny_model(True)
    config = EngineConfig(activation_policy=ActivationPolicy.coerce(policy))
    engine = SlideDPEngine(model, config, device=CPU, compute_dtype=torch.float32, planner=planner)
    try:
        engine.attach_optimizer(adamw_groups(model))
        losses, memory = [], []
        for x in batches(STEPS):
            loss = loss_of(model, x)
            loss.backward()
            assert engine.end_step()
            losses.append(loss.item())
            memory.append(engine.device_memory())
        reserve = 3 * engine.layout.max_unit * 4 + engine.layout.max_unit * 4
        return losses, engine.state_dict(), memory, reserve
    finally:
        engine.close()


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    # room for the streamed parameters and about half of what no checkpointing would keep
    probe = run(AutoPolicy(memory_budget=10**9, save_to=path))
    budget = probe[3] + 200_000
    path.unlink()
    planner = AutoPolicy(memory_budget=budget, save_to=path)
    return planner, run(planner), budget, path


def test_the_plan_fits_the_budget_and_is_what_the_engine_then_retains(planned):
    planner, (_, _, memory, reserve), budget, _ = planned
    report = planner.plan.report
    assert report["budget_bytes"] == budget - reserve
    assert report["retained_bytes"] <= budget - reserve
    assert set(report["plan"]) == {"layers.0", "layers.1"}
    # the accounting of the steps that ran under the plan agrees with the calibration
    assert memory[-1]["retained_activation_bytes"] == report["retained_bytes"]


def test_the_plan_is_optimal_among_uniform_plans_and_reports_its_search(planned):
    planner = planned[0]
    r = planner.plan.report
    fixed = Fixed(**r["fixed_seconds"], h2d_rate=r["link_bytes_per_s"]["h2d"], d2h_rate=r["link_bytes_per_s"]["d2h"])
    options = [Option(**o) for o in r["options"]]
    for o in options:
        if 2 * o.retained_bytes <= r["budget_bytes"]:
            assert r["predicted"]["step"] <= predict([o, o], fixed)["step"] * (1 + 1e-9), o.policy
    assert {m for m in r["measured"]} == set(planner.modes)
    assert r["measured"]["none"]["retained_bytes"] > r["measured"]["full"]["retained_bytes"] > 0
    assert r["search_seconds"] > 0
    if r["saving_seconds_per_step"] > 0:
        assert r["break_even_steps"] == pytest.approx(r["search_seconds"] / r["saving_seconds_per_step"])


def test_planned_training_is_bit_identical_and_the_saved_plan_is_reused_without_measuring(planned):
    planner, (losses, state, _, _), _, path = planned
    ref_losses, ref_state, _ = train(None)
    assert losses == ref_losses
    assert all(torch.equal(state[k], ref_state[k]) for k in ref_state)
    saved = json.loads(path.read_text())
    assert saved["activations"] == planner.plan.activations.to_dict()
    assert ActivationPolicy.coerce(str(path)) == planner.plan.activations
    again = train(str(path))
    assert again[0] == ref_losses


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"memory_budget": 0}, "memory_budget"),
        ({"memory_budget": 1.5}, "fraction"),
        ({"modes": ("sometimes",)}, "mode"),
        ({"ratios": (2.0,)}, "offload"),
    ],
)
def test_bad_autopolicy_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AutoPolicy(**kwargs)


@pytest.mark.parametrize("ratios", [(0.0, 0.5, 1.0), (0.0,)])
def test_an_impossible_budget_stops_the_first_step_naming_the_smallest_feasible_one(ratios):
    with pytest.raises(ValueError, match="smallest feasible memory_budget is") as err:
        run(AutoPolicy(memory_budget=1000, ratios=ratios))
    smallest = int(str(err.value).split("memory_budget is ")[1].split(" bytes")[0].replace(",", ""))
    planner = AutoPolicy(memory_budget=smallest, ratios=ratios)
    run(planner)  # exactly that budget is feasible
    assert planner.plan.report["retained_bytes"] <= planner.plan.report["budget_bytes"]


@pytest.mark.parametrize("budget", [10**9, None], ids=["ample", "none-on-cpu"])
def test_ample_memory_keeps_everything_on_the_device_without_recompute(budget):
    planner = AutoPolicy(memory_budget=budget)
    run(planner)
    assert set(planner.plan.report["plan"].values()) == {"none@0"}


def test_a_fractional_budget_needs_a_gpu():
    with pytest.raises(ValueError, match="CUDA"):
        run(AutoPolicy(memory_budget=0.5))
