"""Several hosts: the collectives between hosts, the two host layouts, the scaling CLI and bad input."""

import pytest

from slidedp_lightning.constants import LEDGER_BYTES_PER_PARAM, update_bytes_per_param
from slidedp_lightning.steptime import StepConfig, analyze, load_config, load_profile, simulate
from slidedp_lightning.steptime.__main__ import main, scaling_rows
from slidedp_lightning.steptime.graph import host_ledger_bytes, host_update_bytes, net_collective
from slidedp_lightning.steptime.ops import build_ops
from slidedp_lightning.steptime.profiles import (
    GB,
    SOURCE_KINDS,
    Profile,
    load_network,
    shipped_networks,
    shipped_profiles,
)
from slidedp_lightning.steptime.workload import units


def _cfg(n: int, layout: str, precision: str = "bf16-mixed", model: str = "qwen3-14b", batch: int = 4):
    return StepConfig(
        load_config(model),
        batch,
        1024,
        8,
        "sharded",
        activation="full",
        precision=precision,
        hosts=n,
        host_layout=layout,
    )


def test_network_constants_are_sourced():
    for name in shipped_networks():
        net = load_network(name)
        assert all(e["source"].startswith(SOURCE_KINDS) for e in net["constants"].values())
    for name in shipped_profiles():
        p = load_profile(name)
        assert p.net_gbps > 0 and p.sources["net_gbps"].startswith(SOURCE_KINDS)
    p = load_profile("h100x8").with_network("roce100")
    assert p.net_gbps == 12.5 and p.capacities(8, 4)["net"] == pytest.approx(12.5 * GB / 8)  # ranks share the NIC
    assert "net" not in p.capacities(8)  # one host: no network


def test_collective_formulas():
    lat = 1e-5
    assert net_collective("all_reduce", 800.0, 4, lat) == (
        {"net": pytest.approx(2 * 3 / 4 * 800.0)},
        pytest.approx(6 * lat),
    )
    assert net_collective("reduce_scatter", 800.0, 4, lat) == (
        {"net": pytest.approx(3 / 4 * 800.0)},
        pytest.approx(3 * lat),
    )
    assert net_collective("all_gather", 800.0, 2, lat) == ({"net": pytest.approx(400.0)}, pytest.approx(lat))
    assert net_collective("all_reduce", 800.0, 1, lat) == ({}, 0.0)
    # in the graph: per rank and unit, replicated all-reduces 2(N-1)/N of its P_u*4/R shard over the network;
    # host-sharded reduce-scatters and gathers in one flat ring over all k = N R ranks: each rank sends (k-1)/k of
    # the unit, each host's network carries (k-1)/k of it (1/R per rank)
    p = load_profile("h100x8")
    cfg_r, cfg_s = _cfg(4, "replicated"), _cfg(4, "sharded")
    params = units(cfg_r.model, 1024, "full")[5].params
    ar = [op for op in build_ops(cfg_r, p, 1) if op.unit == 5 and op.lane == "net"]
    assert len(ar) == 1 and ar[0].name == "all_reduce_net"
    assert ar[0].demand["net"] == pytest.approx(2 * 3 / 4 * params * 4 / 8)
    assert ar[0].fixed == pytest.approx(6 * p.net_latency_s)
    ops_s = [op for op in build_ops(cfg_s, p, 1) if op.unit == 5]
    assert not [op for op in ops_s if op.lane == "net"]
    rs = [op for op in ops_s if op.lane == "reduce"]
    ag = [op for op in ops_s if op.name.startswith("all_gather")]
    k = 32
    assert [op.name for op in rs] == ["reduce_scatter_net"]
    assert rs[0].demand == pytest.approx({"link": (k - 1) / k * params * 4, "net": (k - 1) / k * params * 4 / 8})
    assert rs[0].fixed == pytest.approx((k - 1) * max(p.link_latency_s, p.net_latency_s))
    assert [op.name for op in ag] == ["all_gather_net fwd", "all_gather_net bwd"]  # no separate in-host gather
    assert all(op.demand["net"] == pytest.approx((k - 1) / k * params * 2 / 8) for op in ag)
    assert all(op.lane == "h2d" for op in ag)  # on the fetch path
    h2d = [op for op in ops_s if op.name.startswith("h2d")]
    assert h2d[0].demand["h2d"] == pytest.approx(params * 2 / 32)  # the rank's 1/(N R) shard


def test_host_sharded_divides_update_and_ledger_by_n():
    p = load_profile("h100x8")
    one = StepConfig(load_config("qwen3-14b"), 4, 1024, 8, "sharded", activation="full")
    a1 = analyze(one, p)
    per = update_bytes_per_param(4, rows=1, bf16_out=True)
    assert host_update_bytes(one) == pytest.approx(one.model.total_params * per)
    assert host_ledger_bytes(one) == pytest.approx(LEDGER_BYTES_PER_PARAM * one.model.total_params)
    for n in (2, 4, 16):
        rep, sh = _cfg(n, "replicated"), _cfg(n, "sharded")
        ar, ash = analyze(rep, p), analyze(sh, p)
        # replicated: every host updates and stores the whole model, as one host does
        assert host_update_bytes(rep) == pytest.approx(host_update_bytes(one))
        assert host_ledger_bytes(rep) == pytest.approx(host_ledger_bytes(one))
        assert ar.lanes["update"] == pytest.approx(a1.lanes["update"], rel=1e-9)
        assert ar.bounds["cpu"] == pytest.approx(a1.bounds["cpu"], rel=1e-9)
        # host-sharded: 1/N of both
        assert host_update_bytes(sh) == pytest.approx(host_update_bytes(one) / n)
        assert host_ledger_bytes(sh) == pytest.approx(host_ledger_bytes(one) / n)
        assert ash.lanes["update"] == pytest.approx(a1.lanes["update"] / n, rel=1e-9)
        assert ash.bounds["cpu"] == pytest.approx(a1.bounds["cpu"] / n, rel=1e-9)
        # network time per step: replicated 2(N-1)/N x 4 B/param, host-sharded (k-1)/k x (4 + 2 + 2), k = N R
        total = rep.model.total_params
        net, k = p.net_gbps * GB, 8 * n
        assert ar.bounds["net"] == pytest.approx(2 * (n - 1) / n * 4 * total / net, rel=1e-9)
        assert ash.bounds["net"] == pytest.approx((k - 1) / k * 8 * total / net, rel=1e-9)


def test_slow_network_prefers_replicated():
    """FP32 parameters on 25 GbE: host-sharded gathers 2 x 4 B/param per step on top of its 4 B/param reduce-scatter
    in flat rings over all k = N R ranks, replicated all-reduces 2 x 4 B/param between hosts: 12 (k-1)/k vs
    8 (N-1)/N B/param per host on a network that bounds both."""
    p = load_profile("h100x8").with_network("eth25")
    for n in (2, 8):
        rep, sh = _cfg(n, "replicated", "32-true"), _cfg(n, "sharded", "32-true")
        ar, ash = analyze(rep, p), analyze(sh, p)
        assert max(ar.bounds, key=ar.bounds.get) == "net" and max(ash.bounds, key=ash.bounds.get) == "net"
        k = 8 * n
        assert ash.bounds["net"] == pytest.approx(12 * (k - 1) / k / (8 * (n - 1) / n) * ar.bounds["net"], rel=1e-9)
        sr, ss = simulate(rep, p), simulate(sh, p)
        assert sr.step_time < ss.step_time and ar.step_time < ash.step_time
        assert sr.bottleneck == "host-bound (net)"


def test_update_bound_prefers_host_sharded():
    """Fast network (8 x 400 Gb/s), small batch: one host's CPU update of the whole model outlasts the compute;
    host-sharded updates 1/N of it."""
    p = load_profile("h100x8")  # ib_ndr400x8
    for n in (2, 8):
        rep, sh = _cfg(n, "replicated"), _cfg(n, "sharded")
        ar = analyze(rep, p)
        assert max(ar.bounds, key=ar.bounds.get) == "cpu"
        sr, ss = simulate(rep, p), simulate(sh, p)
        assert sr.bottleneck == "host-bound (update)"
        assert ss.step_time < sr.step_time and analyze(sh, p).step_time < ar.step_time


def test_scaling_rows_mark_the_winner():
    p = load_profile("h100x8")
    base = StepConfig(load_config("qwen3-14b"), 4, 1024, 8, "sharded", activation="full")
    rows = scaling_rows(base, p, (16, 32))
    assert [r["hosts"] for r in rows] == [2, 4]
    assert all(r["winner"] == "sharded" and "host-update-bound" in r["why"] for r in rows)
    assert rows[1]["sharded"]["tokens_per_s"] == pytest.approx(4 * 8 * 4 * 1024 / rows[1]["sharded"]["step_time"])


def test_cli_hosts_and_scaling(capsys):
    args = ["--model", "qwen3-14b", "--hardware", "h100x8", "--batch", "4", "--seq", "1024", "--activation", "full"]
    assert (
        main(
            [
                "predict",
                *args,
                "--gpus",
                "8",
                "--hosts",
                "4",
                "--host-layout",
                "sharded",
                "--param-route",
                "sharded",
                "--network",
                "roce100",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for word in ("hosts N=4", "layout sharded", "12.5 GB/s", "net", "limit:", "ledger"):
        assert word in out
    assert main(["scaling", *args, "--network", "eth25", "--precision", "32-true"]) == 0
    out = capsys.readouterr().out
    for total in ("16", "32", "64", "128"):
        assert f"\n{total:>5s}" in out
    assert "replicated (+" in out and "network-bound" in out


def test_bad_host_inputs(capsys):
    m = load_config("qwen3-14b")
    with pytest.raises(ValueError, match="hosts must be an integer >= 1"):
        StepConfig(m, 1, 8, 8, hosts=0)
    with pytest.raises(ValueError, match="unknown host_layout"):
        StepConfig(m, 1, 8, 8, hosts=2, host_layout="striped")
    with pytest.raises(ValueError, match="use param_route 'sharded'"):
        StepConfig(m, 1, 8, 8, "full", hosts=2, host_layout="sharded")
    with pytest.raises(ValueError, match="use grad_route 'gpu_reduce'"):
        StepConfig(m, 1, 8, 8, "full", "host_reduce", hosts=2)
    with pytest.raises(ValueError, match="single-host route"):
        StepConfig(m, 1, 8, 8, "replicated", hosts=2)
    with pytest.raises(ValueError, match="unknown network 'carrier-pigeon'"):
        load_profile("h100x8").with_network("carrier-pigeon")
    data = load_profile("h100x8").to_json()
    del data["constants"]["net_gbps"], data["constants"]["net_latency_s"]
    bare = Profile.from_json(data)
    with pytest.raises(ValueError, match="no inter-host network"):
        simulate(StepConfig(m, 1, 8, 8, hosts=2), bare)
    simulate(StepConfig(load_config("qwen3-tiny"), 1, 8, 2), Profile.from_json(load_profile("rtx4090x4").to_json()))
    data2 = load_profile("h100x8").to_json()
    del data2["constants"]["net_latency_s"]
    with pytest.raises(ValueError, match="needs all of"):
        Profile.from_json(data2)
    args = ["--model", "qwen3-14b", "--hardware", "h100x8", "--batch", "1", "--seq", "8"]
    assert main(["predict", *args, "--gpus", "8", "--hosts", "0"]) == 2
    assert "hosts must be an integer >= 1" in capsys.readouterr().err
    assert main(["predict", *args, "--gpus", "8", "--hosts", "2", "--network", "nope"]) == 2
    assert "unknown network 'nope'" in capsys.readouterr().err
    assert main(["scaling", *args, "--gpus", "3"]) == 2
    assert "not a multiple of 3" in capsys.readouterr().err
    assert main(["scaling", *args, "--total-gpus", "16,x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err


def test_the_model_knows_each_ledger_mode():
    """Ledger bytes, update traffic and H2D bytes of the compact modes, taken from the config."""
    from dataclasses import replace

    from slidedp_lightning.constants import QUANT_BLOCK, ledger_bytes_per_param

    state8 = 4 + 2 * (1 + 4 / QUANT_BLOCK)  # master and two int8 moments with their scales

    base = StepConfig(load_config("qwen3-14b"), 4, 1024, 8, "sharded", activation="full")
    n = base.model.total_params
    int8 = replace(base, optimizer_state="int8")
    lean = replace(int8, bf16_copy=False)
    assert (
        host_ledger_bytes(int8) == pytest.approx(ledger_bytes_per_param("int8") * n) == pytest.approx((state8 + 2) * n)
    )
    assert host_ledger_bytes(lean) == pytest.approx(state8 * n)
    assert host_update_bytes(base) == pytest.approx(30 * n)  # 28 B + the BF16 copy
    assert host_update_bytes(int8) == pytest.approx((2 * state8 + 4 + 2) * n)
    assert host_update_bytes(lean) == pytest.approx((2 * state8 + 4) * n)
    profile = load_profile(shipped_profiles()[0])

    def h2d(cfg: StepConfig) -> float:
        return sum(op.demand.get("h2d", 0.0) for op in build_ops(cfg, profile, steps=1) if op.name.startswith("h2d"))

    assert h2d(lean) == pytest.approx(h2d(base))  # converted on the host: BF16 over the link
    assert h2d(replace(lean, h2d_convert="device")) == pytest.approx(2 * h2d(base))  # FP32 over the link
    with pytest.raises(ValueError, match="optimizer_state"):
        replace(base, optimizer_state="int4")


def test_the_state_on_disk_is_a_resource_of_the_update():
    """With the moments on disk every update also reads and writes them there: the ledger loses them, the disk's
    bound is those bytes over its rate, a slow enough disk bounds the step, and a profile without one is refused."""
    from dataclasses import replace

    from slidedp_lightning.steptime import analyze
    from slidedp_lightning.steptime.__main__ import limit
    from slidedp_lightning.steptime.profiles import Profile

    base = StepConfig(load_config("qwen3-tiny"), 8, 256, 1, "full", activation="full")
    disk = replace(base, state_on_disk=True)
    n = base.model.total_params
    assert host_ledger_bytes(base) - host_ledger_bytes(disk) == pytest.approx(8 * n)
    profile = load_profile("h200x1")
    with pytest.raises(ValueError, match="disk_gbps"):
        simulate(disk, profile)
    for gbps, bound_by_disk in ((1e4, False), (1e-3, True)):
        with_disk = Profile(profile.name, {**profile.values, "disk_gbps": gbps}, profile.sources)
        ana = analyze(disk, with_disk)
        assert ana.bounds["disk"] == pytest.approx(16 * n / (gbps * 1e9), rel=1e-3)  # both moments, both ways
        assert (limit(ana) == "disk-bound") == bound_by_disk
        sim = simulate(disk, with_disk)
        assert sim.step_time >= ana.bounds["disk"] * (1 - 1e-9)
        if not bound_by_disk:  # a fast disk costs (almost) nothing
            assert sim.step_time == pytest.approx(simulate(base, with_disk).step_time, rel=0.02)
    # the master there too: 4 B/param more out of the ledger, 8 more over the disk a step
    master = replace(disk, master_on_disk=True)
    assert host_ledger_bytes(disk) - host_ledger_bytes(master) == pytest.approx(4 * n)
    slow = Profile(profile.name, {**profile.values, "disk_gbps": 1e-3}, profile.sources)
    assert analyze(master, slow).bounds["disk"] == pytest.approx(24 * n / 1e6, rel=1e-3)
    with pytest.raises(ValueError, match="master_on_disk"):
        replace(base, master_on_disk=True)
