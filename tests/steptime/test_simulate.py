"""The lane simulator and the analytic model on small graphs and known regimes."""

import pytest

from slidedp_lightning.steptime import StepConfig, analyze, load_config, load_profile, simulate
from slidedp_lightning.steptime.analytic import pipeline
from slidedp_lightning.steptime.graph import Op
from slidedp_lightning.steptime.simulate import classify, run


def test_fluid_sharing_and_lanes():
    cap = {"h2d": 10.0, "gpu": 1.0}
    ops = [
        Op("a", "h2d", 0, 0, {"h2d": 10.0}),
        Op("b", "d2h", 0, 0, {"h2d": 10.0}),
        Op("c", "compute", 0, 0, {"gpu": 1.0}, deps=[0]),
    ]
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


def _sf(r: int, model: str = "qwen3-8b"):
    cfg = StepConfig(load_config(model), 2, 256, r, "slideformer", "host_reduce", activation="full")
    return cfg, load_profile("a800x8_bridge")


def test_slideformer_structure():
    """The paper's baseline as modelled: one transfer thread, D2H after the previous unit's update, rank 0 updates."""
    cfg, p = _sf(4)
    sim = simulate(cfg, p)
    xfer = sorted((s.start, s.end) for s in sim.spans if s.lane in ("h2d", "d2h"))
    assert all(a[1] <= b[0] + 1e-12 for a, b in zip(xfer, xfer[1:]))  # H2D and D2H of a rank never overlap
    step1 = [s for s in sim.spans if s.step == 1]
    upd_end = {u: max(s.end for s in step1 if s.lane == "update" and s.unit == u) for u in {s.unit for s in step1}}
    for s in step1:
        if s.lane == "d2h" and s.unit + 1 in upd_end:
            assert s.start >= upd_end[s.unit + 1] - 1e-12  # one gradient buffer
    first_fetch = min(s.start for s in step1 if s.lane == "h2d")
    assert first_fetch >= max(s.end for s in sim.spans if s.step == 0 and s.lane == "update") - 1e-12  # drained
    assert sim.busy["reduce"] == 0.0  # no GPU collective: gradients are summed on the host


def test_slideformer_rank0_update_grows_with_r():
    from slidedp_lightning.steptime.slideformer import slideformer_reduce_bytes

    assert slideformer_reduce_bytes(8) - slideformer_reduce_bytes(4) == 72  # 4 more BF16 slots, 18 B each
    p = load_profile("a800x8_bridge")
    assert p.capacities(8)["updater"] == pytest.approx(p.update_rate(4))  # rank 0 on its C/R = 4 cores
    a4, a8 = analyze(*_sf(4)), analyze(*_sf(8))
    # rank 0 alone: more bytes per parameter, fewer cores, the same parameters (not 1/R of them)
    expect = slideformer_reduce_bytes(8) / slideformer_reduce_bytes(4) * p.update_rate(8) / p.update_rate(4)
    assert a8.lanes["update"] / a4.lanes["update"] == pytest.approx(expect, rel=1e-6)
    # every rank uploads every full unit: per-rank H2D bytes do not shrink with R
    assert a8.bounds["h2d"] == pytest.approx(a4.bounds["h2d"] * p.h2d_per_gpu(4) / p.h2d_per_gpu(8), rel=1e-6)


def test_slideformer_config_errors():
    m = load_config("qwen3-8b")
    with pytest.raises(ValueError, match="use grad_route 'host_reduce' and precision 'bf16-mixed'"):
        StepConfig(m, 1, 8, 2, "slideformer")
    with pytest.raises(ValueError, match="tied embeddings"):
        simulate(
            StepConfig(load_config("qwen3-tiny"), 1, 8, 2, "slideformer", "host_reduce"), load_profile("a800x8_bridge")
        )


@pytest.mark.parametrize("grad_route", ["gpu_reduce", "host_reduce"])
def test_a_disk_bound_step_is_its_disk_time_without_the_graphs_start_up_backlog(grad_route):
    """The step reported is a steady one: bound by a slow disk, it takes the disk's time for one step's reads and
    writes, not also the backlog the graph starts with (the step before's writes, queued ahead of the first reads;
    a two-step simulation reported 1.4x that)."""
    from dataclasses import replace

    from slidedp_lightning.steptime.profiles import Profile

    profile = load_profile("h200x1")
    slow = Profile(profile.name, {**profile.values, "disk_gbps": 1e-3}, profile.sources)
    cfg = StepConfig(load_config("qwen3-tiny"), 8, 256, 1, "full", grad_route, activation="full", state_on_disk=True)
    bound = analyze(cfg, slow).bounds["disk"]
    assert simulate(cfg, slow).step_time == pytest.approx(bound, rel=0.01)
    master = replace(cfg, master_on_disk=True, precision="bf16-mixed")
    assert simulate(master, slow).step_time == pytest.approx(analyze(master, slow).bounds["disk"], rel=0.01)
