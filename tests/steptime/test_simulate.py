"""The lane simulator and the analytic model on small graphs and known regimes."""

import pytest

from slidedp_lightning.steptime import StepConfig, analyze, load_config, load_profile, simulate
from slidedp_lightning.steptime.analytic import pipeline
from slidedp_lightning.steptime.graph import Op
from slidedp_lightning.steptime.simulate import classify, run


def test_fluid_sharing_and_lanes():
    cap = {"h2d": 10.0, "gpu": 1.0}
    ops = [Op("a", "h2d", 0, 0, {"h2d": 10.0}), Op("b", "d2h", 0, 0, {"h2d": 10.0}),
           Op("c", "compute", 0, 0, {"gpu": 1.0}, deps=[0])]
    times = run(ops, cap)
    assert times[0] == pytest.approx((0.0, 2.0)) and times[1] == pytest.approx((0.0, 2.0))  # one link, shared
    assert times[2] == pytest.approx((2.0, 3.0))
    same_lane = [Op("a", "h2d", 0, 0, {"h2d": 10.0}), Op("b", "h2d", 0, 0, {"h2d": 10.0}, fixed=0.5)]
    assert run(same_lane, cap)[1] == pytest.approx((1.0, 2.5))


def test_pipeline():
    assert pipeline([[1.0, 2.0]] * 3) == pytest.approx(7.0)
    assert pipeline([[2.0, 1.0]] * 3) == pytest.approx(7.0)


def test_classify():
    assert classify({"compute": 2.0, "h2d": 1.0}) == "gpu-bound"
    assert classify({"compute": 1.0, "update": 3.0, "h2d": 2.0}) == "host-bound (update)"


def test_host_work_grows_with_r_on_replicated():
    m, p = load_config("qwen3-14b"), load_profile("a800x8_bridge")
    a4 = analyze(StepConfig(m, 8, 1024, 4, "replicated", activation="full"), p)
    a8 = analyze(StepConfig(m, 8, 1024, 8, "replicated", activation="full"), p)
    assert a8.lanes["update"] == pytest.approx(2 * a4.lanes["update"], rel=1e-6)  # update x R on a fixed host


def test_simulator_respects_lower_bounds():
    m, p = load_config("qwen3-8b"), load_profile("rtx4090x4")
    for route in ("full", "sharded"):
        for grad in ("gpu_reduce", "host_reduce"):
            cfg = StepConfig(m, 4, 1024, 4, route, grad, chunk_bytes=64 << 20)
            sim, ana = simulate(cfg, p), analyze(cfg, p)
            assert sim.step_time >= max(ana.bounds.values()) * (1 - 1e-9)
            assert sim.step_time >= ana.lanes["compute"] * (1 - 1e-9)


def test_chunks_shorten_the_exposed_tail():
    m, p = load_config("qwen3-8b"), load_profile("h200x1")
    whole = simulate(StepConfig(m, 2, 1024, 1), p)
    chunked = simulate(StepConfig(m, 2, 1024, 1, chunk_bytes=32 << 20), p)
    assert chunked.step_time < whole.step_time


def test_bad_step_configs():
    m = load_config("qwen3-tiny")
    with pytest.raises(ValueError, match="unknown param_route"):
        StepConfig(m, 1, 8, 2, param_route="ring")
    with pytest.raises(ValueError, match="unknown grad_route"):
        StepConfig(m, 1, 8, 2, grad_route="cpu")
    with pytest.raises(ValueError, match="use grad_route 'gpu_reduce'"):
        StepConfig(m, 1, 8, 2, "replicated", "host_reduce")
    with pytest.raises(ValueError, match="batch must be"):
        StepConfig(m, 0, 8, 2)
    with pytest.raises(ValueError, match="cannot model R=8"):
        simulate(StepConfig(m, 1, 8, 8), load_profile("rtx4090x4"))
