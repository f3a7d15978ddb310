"""Several hosts as the runtime runs them: what the compute thread waits for, flat collectives of the host-sharded
layout, the update backpressure, the loss all-reduce, co-located hosts, and the calibration's fits and probe."""

import dataclasses
import math

import pytest

from slidedp_lightning.steptime import StepConfig, load_config, load_profile, simulate
from slidedp_lightning.steptime.calibrate import _fit_points, build_profile, measure_network, shared_cores
from slidedp_lightning.steptime.graph import flat_collective, loss_sync_latency
from slidedp_lightning.steptime.ops import build_ops
from slidedp_lightning.steptime.profiles import COLOCATED_KEY, GB, Profile


def _machine(**extra) -> Profile:
    """A calibrated CPU machine of 2 cores with a loopback network between co-located hosts."""
    values = {
        "gpus": 2,
        "gpu_flops": 5e10,
        "gpu_efficiency": 1.0,
        "bwd_fwd_ratio": 2.0,
        "op_overhead_s": 5e-4,
        "step_overhead_s": 1e-4,
        "h2d_gbps": {"2": 20.0},
        "d2h_gbps": {"2": 20.0},
        "copy_latency_s": 0.0,
        "link_kind": "loopback",
        "link_gbps": 0.5,
        "link_latency_s": 3e-4,
        "host_dram_gbps": 80.0,
        "cpu_cores": 2,
        "update_gbps": {"2": 100.0},
        "host_is_device": True,
        "net_gbps": 2.0,
        "net_latency_s": 4e-4,
        COLOCATED_KEY: 2.0,
        **extra,
    }
    return Profile("machine", values, {k: "probe: test" for k in values})


def _cfg(layout: str, hosts: int = 2, **kw) -> StepConfig:
    route = "sharded" if layout == "sharded" else kw.pop("param_route", "full")
    return StepConfig(
        load_config("qwen3-tiny"), 8, 26, 2, route, precision="32-true", hosts=hosts, host_layout=layout, **kw
    )


def test_flat_collective():
    demand, fixed = flat_collective("reduce_scatter", "loopback", 800.0, 2, 2, 1e-4, 3e-4)
    assert demand == pytest.approx({"link": 600.0, "net": 300.0}) and fixed == pytest.approx(3 * 3e-4)
    demand, fixed = flat_collective("all_gather", "pcie", 800.0, 4, 1, 1e-4, 3e-4)  # one host: no network
    assert demand == pytest.approx({"h2d": 600.0, "d2h": 600.0, "link": 600.0}) and fixed == pytest.approx(3 * 1e-4)
    demand, fixed = flat_collective("all_gather", "loopback", 800.0, 1, 4, 1e-4, 3e-4)  # one rank per host
    assert demand == pytest.approx({"net": 600.0}) and fixed == pytest.approx(3 * 3e-4)
    assert flat_collective("all_gather", "loopback", 800.0, 1, 1, 1e-4, 3e-4) == ({}, 0.0)
    with pytest.raises(ValueError, match="unknown flat collective"):
        flat_collective("all_reduce", "loopback", 800.0, 2, 2, 1e-4, 3e-4)


def test_replicated_layout_reduces_off_the_compute_thread():
    """Several hosts, replicated layout: a unit's in-host reduce-scatter, then its all-reduce between hosts on the
    reduced shard, both off the compute thread (no compute op waits for either), as on one host."""
    p = _machine()
    for hosts in (1, 2):
        ops = build_ops(_cfg("replicated", hosts), p, 1)
        reduces = [i for i, op in enumerate(ops) if op.lane == "reduce"]
        nets = [i for i, op in enumerate(ops) if op.lane == "net"]
        computes = [i for i, op in enumerate(ops) if op.lane == "compute"]
        assert not [r for r in reduces + nets if any(r in ops[c].deps for c in computes)]
        assert len(nets) == (len(reduces) if hosts == 2 else 0)
        assert all(ops[i].name == "all_reduce_net" and ops[ops[i].deps[0]].lane == "reduce" for i in nets)
    t1 = simulate(_cfg("replicated", 2), p)
    free = simulate(_cfg("replicated", 2), p.with_network("ib_ndr400x8"))
    assert t1.exposed["reduce"] > 0 and free.step_time > 0


def test_host_sharded_layout_runs_flat_rings():
    p = _machine()
    ops = build_ops(_cfg("sharded"), p, 1)
    assert not [op for op in ops if op.lane == "net"]
    k = 4
    for unit_ops in [[op for op in ops if op.unit == u] for u in range(6)]:
        rs = [op for op in unit_ops if op.lane == "reduce"]
        assert [op.name for op in rs] == ["reduce_scatter_net"] and rs[0].fixed == pytest.approx((k - 1) * 4e-4)
        assert not [op for op in unit_ops if op.name.startswith("all_gather ")]  # no in-host gather of its own
    d2h = [op for op in ops if op.lane == "d2h"]
    assert d2h and all(not op.demand and op.fixed == 0 for op in d2h)  # a CPU device: the update reads in place


def test_update_backpressure():
    """max_units_in_flight = m: the reduction of the (k+m)-th unit of a backward (and the compute after it) waits for
    the update of the k-th."""
    p = _machine()
    base = _cfg("replicated", 1)
    ops = build_ops(dataclasses.replace(base, max_units_in_flight=2), p, 1)
    updates = [i for i, op in enumerate(ops) if op.lane == "update"]
    reduces = [i for i, op in enumerate(ops) if op.lane == "reduce"]
    assert [op for op in ops if op.lane == "reduce"][0].unit == 5  # backward order

    def waits_for(i: int) -> list[int]:  # deps of op i, through the compute thread's issue of the unit
        deps = ops[i].deps
        return [e for d in deps for e in (waits_for(d) if ops[d].name in ("issue", "fill") else [d])]

    for k, r in enumerate(reduces):
        assert ops[ops[r].deps[0]].name == "fill"  # a CPU device: the compute thread fills the flat gradient first
        gated = [d for d in waits_for(r) if d in updates]
        assert gated == ([updates[k - 2]] if k >= 2 else [])
        nxt = next((i for i in range(r, len(ops)) if ops[i].lane == "compute"), None)
        if k >= 2 and nxt is not None:
            assert updates[k - 2] in ops[nxt].deps
    free = build_ops(base, p, 1)
    assert not any(d for op in free if op.lane == "reduce" for d in op.deps if free[d].lane == "update")
    with pytest.raises(ValueError, match="max_units_in_flight"):
        StepConfig(load_config("qwen3-tiny"), 1, 8, 2, max_units_in_flight=0)


def test_loss_sync():
    p = _machine()
    cfg = _cfg("replicated", 2, loss_sync=True)
    assert loss_sync_latency(cfg.gpus, cfg.hosts, p) == pytest.approx(
        2 * 3 * 4e-4
    )  # 4 ranks, the slower latency per step
    assert loss_sync_latency(cfg.gpus, 1, p) == pytest.approx(2 * 3e-4)
    loss = [op for op in build_ops(cfg, p, 1) if op.name == "loss"]
    assert loss[0].fixed == pytest.approx(2 * 3 * 4e-4)  # the all-reduce: latency
    assert loss[0].demand["gpu"] == pytest.approx(p.step_overhead_s * p.gpu_flops)  # the loss: work on the cores
    assert simulate(cfg, p).step_time > simulate(dataclasses.replace(cfg, loss_sync=False), p).step_time


def test_op_overhead_is_work_on_a_cpu_device():
    """A compute op's overhead is host time: on a CPU "device" it shares the cores with everything else (as
    FLOP-equivalents), on a GPU machine it is latency."""
    cfg = _cfg("replicated", 1)
    cpu = _machine()
    fwd = [op for op in build_ops(cfg, cpu, 1) if op.name == "forward"]
    assert all(op.fixed == 0 for op in fwd)
    assert fwd[1].demand["gpu"] == pytest.approx(
        cfg.tokens * 2 * cfg.model.layer_matmul_params() + cfg.tokens * 2 * 26 * 4 * 32 + 5e-4 * 5e10
    )
    gpu = load_profile("rtx4090x4")
    fwd = [op for op in build_ops(StepConfig(load_config("qwen3-tiny"), 8, 26, 2), gpu, 1) if op.name == "forward"]
    assert all(op.fixed == pytest.approx(gpu.op_overhead_s) for op in fwd)


def test_colocated_hosts_share_the_machine():
    p = _machine(**{COLOCATED_KEY: 2.4})
    one, two = p.capacities(2), p.capacities(2, 2)
    assert one["cores"] == pytest.approx(1.0) and two["cores"] == pytest.approx(2.4 / 4)
    assert two["dram"] == pytest.approx(one["dram"] / 2)
    for key in ("gpu", "h2d", "d2h", "link", "cpu"):  # a rank's own rates; the cores share them out
        assert two[key] == pytest.approx(one[key])
    assert two["net"] == pytest.approx(2.0 * GB / 2)
    apart = p.with_network("roce100")  # hosts on a real network each have their own machine
    assert not apart.colocated and apart.capacities(2, 2)["cores"] == pytest.approx(1.0)
    assert simulate(_cfg("replicated"), p).step_time > simulate(_cfg("replicated"), apart).step_time
    data = p.to_json()
    del data["constants"]["net_gbps"], data["constants"]["net_latency_s"]
    with pytest.raises(ValueError, match=COLOCATED_KEY):
        Profile.from_json(data)
    data = p.to_json()
    data["constants"][COLOCATED_KEY]["value"] = True
    with pytest.raises(ValueError, match=COLOCATED_KEY):
        Profile.from_json(data)


def test_fit_points():
    xs = [1e4, 1e5, 1e6, 1e7]
    lat, rate = _fit_points(xs, [2e-4 + x / 1e9 for x in xs])
    assert lat == pytest.approx(2e-4) and rate == pytest.approx(1e9)
    lat, rate = _fit_points(xs, [x / 2e9 for x in xs])  # no latency: through the origin
    assert lat == pytest.approx(0.0, abs=1e-12) and rate == pytest.approx(2e9)
    noisy = [2e-4 + x / 1e9 for x in xs]
    noisy[0] *= 3  # a slow small point moves the latency, not the rate
    lat, rate = _fit_points(xs, noisy)
    assert lat > 2e-4 and rate == pytest.approx(1e9, rel=0.1)
    with pytest.raises(RuntimeError, match="did not grow"):
        _fit_points(xs, [1.0, 1.0, 0.5, 0.5])


def test_shared_cores_is_bounded_by_the_machine():
    assert shared_cores(2, 2, 2, 1.0, 2.0) == pytest.approx(2.0)  # 4 ranks on 2 cores: half the speed each
    assert shared_cores(2, 2, 2, 1.0, 1.6) == pytest.approx(2.0)  # a slow one-host run cannot add CPUs
    assert shared_cores(2, 2, 4, 1.0, 1.6) == pytest.approx(2.5)  # SMT siblings may
    assert shared_cores(2, 2, 8, 1.0, 0.9) == pytest.approx(4.0)  # never more than the hosts' cores
    assert shared_cores(4, 2, 8, 1.0, 2.5) == pytest.approx(3.2)


def test_build_profile_writes_the_network():
    raw = {
        "gpu_flops": 5e10,
        "op_overhead_s": 1e-4,
        "bwd_fwd_ratio": 2.0,
        "step_overhead_s": 0.0,
        "copy_lat": 0.0,
        "copy_rate": 2e10,
        "link_lat": 3e-4,
        "link_rate": 5e8,
        "upd_rate": 5e10,
    }
    net = {"net_rate": 1e9, "net_lat": 2e-4, "hosts": 2, "ranks": 2, "colocated_cores": 2.2}
    p = build_profile(raw, 2, "qwen3-tiny", 26, net)
    assert p.net_gbps == pytest.approx(2.0) and p.net_latency_s == pytest.approx(2e-4) and p.colocated
    assert all(p.sources[k].startswith("probe:") for k in ("net_gbps", "net_latency_s", COLOCATED_KEY))
    assert p.capacities(2, 2)["net"] == pytest.approx(1e9)  # the measured per-rank rate
    assert not build_profile(raw, 2, "qwen3-tiny", 26).colocated


@pytest.mark.slow
@pytest.mark.integration
def test_network_probe_returns_sane_numbers():
    """4 gloo ranks as 2 hosts x 2 (a few seconds): positive latency and rate, every collective timed."""
    with pytest.raises(ValueError, match="hosts >= 2"):
        measure_network(1, 2)
    # sizes 16x apart (16 KB to 4 MB): the growth with size stays above the timing noise of a loaded 2-core machine
    raw = measure_network(2, 2, sizes=(1 << 12, 1 << 16, 1 << 20), repeats=5)
    assert 0 <= raw["net_lat"] < 0.05 and 1e7 < raw["net_rate"] < 1e12
    assert 0.1 < raw["colocated_cores"] <= 4 and math.isfinite(raw["colocated_cores"])
    for key in ("pair_alone_4096", "pairs_all_1048576", "flat_reduce_scatter_65536", "flat_all_gather_1048576"):
        assert 0 < raw[key] < 5
