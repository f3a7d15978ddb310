"""A CPU "device" as the runtime uses it: fresh pages of large per-use buffers, the compute thread's issue of each
gradient, and the training loop's time per step measured from a run's lane traces."""

import dataclasses
import json

import pytest

from slidedp_lightning.runtime.trace import Tracer
from slidedp_lightning.steptime import StepConfig, load_config, load_profile, simulate
from slidedp_lightning.steptime.__main__ import main
from slidedp_lightning.steptime.calibrate import with_loop
from slidedp_lightning.steptime.ops import build_ops
from slidedp_lightning.steptime.profiles import LOOP_KEY, Profile
from slidedp_lightning.steptime.traces import loop_time, measured, other_threads_cpu
from slidedp_lightning.steptime.workload import ModelShape, units

MiB = 2**20


def _machine(**extra) -> Profile:
    values = {
        "gpus": 2,
        "gpu_flops": 5e10,
        "gpu_efficiency": 1.0,
        "bwd_fwd_ratio": 2.0,
        "op_overhead_s": 5e-4,
        "step_overhead_s": 1e-3,
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
        **extra,
    }
    return Profile("machine", values, {k: "probe: test" for k in values})


FRESH = {"fresh_gbps": 2.0, "alloc_reuse_bytes": 32 * MiB}


def _wide() -> ModelShape:
    """Qwen3 shapes with a vocabulary large enough that the embedding's FP32 buffer is 32 MiB (fresh pages each time)."""
    return load_config(
        {
            "vocab_size": 32768,
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "tie_word_embeddings": False,
            "model_type": "qwen3",
        }
    )


def _cfg(model, route="full", grad="gpu_reduce", batch=1, **kw) -> StepConfig:
    return StepConfig(model, batch, 26, 2, route, grad, precision="32-true", **kw)


def test_fresh_pages_only_above_the_reuse_size():
    """Copies into buffers of at least the reuse size write fresh pages (unit_copies "always": every unit copied;
    under "auto" the large units are computed in the ledger and only their gradients' buffers are fresh)."""
    p, model = _machine(**FRESH), _wide()
    ops = build_ops(_cfg(model, unit_copies="always"), p, 1)
    h2d = {op.unit: op for op in ops if op.lane == "h2d"}
    big = [u for u, op in h2d.items() if "fresh" in op.demand]
    assert big and all(h2d[u].demand["fresh"] == h2d[u].demand["h2d"] >= 32 * MiB for u in big)
    assert any("fresh" not in op.demand for op in h2d.values())  # the block's buffer (2.6 MB) is reused
    fills = [op for op in ops if op.name == "fill"]
    assert {op.unit for op in fills if "fresh" in op.demand} == set(big)
    auto = build_ops(_cfg(model), p, 1)
    assert all(not op.demand for op in auto if op.lane == "h2d" and op.unit in big)  # no copy, no fresh pages
    assert {op.unit for op in auto if op.name == "fill" and "fresh" in op.demand} == set(big)
    # without the constants, or on a GPU, nothing is fresh
    assert not any("fresh" in op.demand for op in build_ops(_cfg(model, unit_copies="always"), _machine(), 1))
    assert not any("fresh" in op.demand for op in build_ops(_cfg(model), load_profile("a800x8_nobridge"), 1))
    always = _cfg(model, unit_copies="always")
    slow = simulate(always, p).step_time
    assert slow > simulate(always, _machine(**{**FRESH, "fresh_gbps": 200.0})).step_time * 1.2


def test_issue_runs_on_the_compute_thread():
    """gpu_reduce on a CPU device: each unit's gradient is issued (overhead + the flat fill and division) on the
    compute thread before its collective; the traces show it on the reduce lane. host_reduce and GPUs have none."""
    p = _machine()
    tiny = load_config("qwen3-tiny")
    ops = build_ops(_cfg(tiny), p, 1)
    us = units(tiny, 26, "none")
    fills = [i for i, op in enumerate(ops) if op.name == "fill"]
    assert sorted(ops[i].unit for i in fills) == list(range(len(us)))
    for i in fills:
        fill = ops[i]
        assert fill.lane == "compute" and fill.shown == "reduce"
        # FP32 on 2 ranks: read the gradient 4, write the flat buffer 4, divide it in place 4 + 4 bytes per parameter
        assert fill.demand["h2d"] == pytest.approx(16 * us[fill.unit].params)
        issue = ops[fill.deps[0]]
        assert issue.name == "issue" and issue.lane == "compute"
        assert issue.demand["gpu"] == pytest.approx(p.op_overhead_s * p.gpu_flops)
        assert any(ops[d].name == "backward" and ops[d].unit == fill.unit for d in issue.deps)
        red = next(o for o in ops if o.lane == "reduce" and o.unit == fill.unit)
        assert red.deps == [i]  # the collective starts once the flat gradient is filled
    assert not any(op.name == "fill" for op in build_ops(_cfg(tiny, grad="host_reduce"), p, 1))
    assert not any(op.name == "fill" for op in build_ops(_cfg(tiny), load_profile("a800x8_nobridge"), 1))
    sim = simulate(_cfg(tiny), p)
    assert any(s.name == "fill" and s.lane == "reduce" for s in sim.spans)  # reported where the traces show it


def test_loop_overhead_is_compute_thread_work():
    p = _machine(**{LOOP_KEY: 0.01})
    tiny = load_config("qwen3-tiny")
    loss = next(op for op in build_ops(_cfg(tiny), p, 1) if op.name == "loss")
    assert loss.demand["gpu"] == pytest.approx((1e-3 + 0.01) * p.gpu_flops)  # the loss + the loop, on the cores
    assert loss.shown == "loop"  # outside the units: not compute in the runtime's traces, nor in the report
    sim = simulate(_cfg(tiny), p)
    assert sim.busy["loop"] == pytest.approx(0.011, rel=0.05) and sim.exposed["loop"] > 0.005
    assert simulate(_cfg(tiny), p).step_time == pytest.approx(
        simulate(_cfg(tiny), _machine()).step_time + 0.01, rel=0.05
    )


@pytest.mark.parametrize(
    "bad",
    [
        {"fresh_gbps": 2.0},
        {"fresh_gbps": 0, "alloc_reuse_bytes": 1},
        {LOOP_KEY: -1.0},
        {LOOP_KEY: "x"},
        {"loss_s_per_token": -1e-6},
    ],
)
def test_bad_constants(tmp_path, bad):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_machine(**bad).to_json()))
    with pytest.raises(ValueError, match="fresh|loop_overhead_s|loss_s_per_token"):
        load_profile(path)


def _trace(tmp_path, ranks: int = 2, steps: int = 6, step_s: float = 0.05):
    """Lane traces as the runtime writes them: per 50 ms iteration, compute 20 ms, a 7 ms stall overlapping an issue
    (reduce lane) of 8 ms, and an h2d copy that is not the compute thread's: 50 - 20 - 10 = 20 ms untraced."""
    for r in range(ranks):
        t = Tracer(str(tmp_path), r)
        t0 = 100.0
        for k in range(steps):
            s = t0 + k * step_s
            t.record("compute", "forward", k, s, s + 0.01)
            t.record("compute", "backward", k, s + 0.01, s + 0.02)
            t.record("reduce", "issue", k, s + 0.022, s + 0.030)
            t.record("stall", "wait update lane", k, s + 0.025, s + 0.032)
            t.record("h2d", "copy", k, s, s + 0.04)
            t.record("reduce", "reduce + return", k, s + 0.03, s + 0.045)
            t.mark_step(k, s, s + step_s - 0.005)  # the step closes 5 ms before the next one's first forward
        t.close()


def test_loop_time_from_traces(tmp_path):
    _trace(tmp_path)
    assert loop_time(tmp_path) == pytest.approx(0.05 - 0.020 - 0.010, abs=1e-6)
    m = measured(tmp_path)  # whole iterations (first forward to the next one's), not the runtime's step window
    assert m["step_time"] == pytest.approx(0.05, abs=1e-6) and m["window"] == pytest.approx(0.045, abs=1e-6)
    assert m["exposed_host"] == pytest.approx(0.05 - 0.02, abs=1e-6) and m["steps"] == 6 - 1 - 2


def test_with_loop_and_cli(tmp_path, capsys):
    _trace(tmp_path / "run")
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(_machine().to_json()))
    got = with_loop(load_profile(prof), tmp_path / "run", tokens=100)
    sync = 2 * 3e-4  # the loss all-reduce over 2 ranks: 2 ring steps
    assert got.loop_overhead == pytest.approx(0.02 - 1e-3 - sync, abs=1e-6)
    per_token = Profile("m", {**load_profile(prof).values, "loss_s_per_token": 2e-5}, load_profile(prof).sources)
    assert with_loop(per_token, tmp_path / "run", tokens=100).loop_overhead == pytest.approx(
        0.02 - 3e-3 - sync, abs=1e-6
    )
    assert got.sources[LOOP_KEY].startswith("probe:")
    assert main(["loop", "--profile", str(prof), "--trace", str(tmp_path / "run"), "--tokens", "100"]) == 0
    assert load_profile(prof).loop_overhead == pytest.approx(got.loop_overhead)
    assert "loop_overhead_s" in capsys.readouterr().out
    with pytest.raises(ValueError, match="multiple of hosts"):
        with_loop(load_profile(prof), tmp_path / "run", 100, hosts=3)
    with pytest.raises(ValueError, match="tokens"):
        with_loop(load_profile(prof), tmp_path / "run", 0)
    assert main(["loop", "--profile", str(prof), "--trace", str(tmp_path / "none"), "--tokens", "100"]) == 2


def test_defaults_unchanged():
    """A profile without the new constants models what it did before: no loop, no fresh pages."""
    p = _machine()
    assert p.loop_overhead == 0.0 and p.fresh_bytes(1e12) == 0.0
    assert "fresh" not in p.capacities(2)
    assert dataclasses.replace(_cfg(load_config("qwen3-tiny"))).gpus == 2


def test_gradient_pages_and_a_loss_per_token():
    """Backward on a CPU device: a weight gradient above the reuse size is written into fresh pages (one op after the
    backward, on the compute thread); the loss grows with the batch when the profile has a per-token part."""
    p, model = _machine(**FRESH), _wide()
    ops = build_ops(_cfg(model), p, 1)
    pages = [op for op in ops if op.name == "gradient pages"]
    assert sorted(op.unit for op in pages) == [0, 2]  # the embedding and the untied head, not the block
    assert all(op.lane == "compute" and op.demand["fresh"] == 32768 * 256 * 4 for op in pages)
    assert not any(op.name == "gradient pages" for op in build_ops(_cfg(load_config("qwen3-tiny")), p, 1))
    q = _machine(loss_s_per_token=1e-4)
    loss = [next(op for op in build_ops(_cfg(model, batch=b), q, 1) if op.name == "loss") for b in (1, 4)]
    assert [op.demand["gpu"] / q.gpu_flops for op in loss] == pytest.approx([1e-3 + 26e-4, 1e-3 + 104e-4])


def test_other_threads_cpu(tmp_path, monkeypatch):
    """The runtime records per step the CPU of the process and of the compute thread; the traces give the other
    threads' CPU per step (a diagnostic the validation scripts keep)."""
    import itertools

    import slidedp_lightning.runtime.trace as trace_module

    proc, thread = itertools.count(0.0, 0.030), itertools.count(0.0, 0.010)  # per call: 30 ms process, 10 ms thread
    monkeypatch.setattr(trace_module.time, "process_time", lambda: next(proc))
    monkeypatch.setattr(trace_module.time, "thread_time", lambda: next(thread))
    _trace(tmp_path / "run")
    monkeypatch.undo()
    assert other_threads_cpu(tmp_path / "run") == pytest.approx(0.020)
