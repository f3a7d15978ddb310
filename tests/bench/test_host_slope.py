"""The host-memory slope's inputs and its table (ledger memory measured per run), systems without their bench
extra reported, and the SlideDP knobs the plan uses (no benchmark runs here)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from bench import tables
from bench.baselines import runner
from bench.baselines.hostmem import Sample, Sampler
from bench.baselines.runner import BENCH_EXTRA, RunResult, run_job
from bench.baselines.workload import SYSTEMS
from bench.configs import SCALES, plan, scale

GB = 1e9


def fake_init(shape, seq: int, root: Path) -> Path:
    return root / f"init-{shape.name}-{seq}.pt"


def systems_results(sc, per_param: dict[str, tuple[float, float | None]]) -> dict[str, RunResult]:
    """Every systems run of ``sc``, ok, with host peak = 1 GB + a B/param and ledger = b B/param (None: none)."""
    out = {}
    for job in plan(sc, Path("/nonexistent"), init=fake_init):
        for run in job.runs:
            if not run.name.startswith("systems/"):
                continue
            total, ledger = per_param.get(run.spec.system, (20.0, None))
            n = run.spec.model.num_params
            res = RunResult(run.name, run.spec, step_s=[0.1, 0.1])
            res.host_peak = int(GB + total * n)
            res.ledger_host_bytes = int(ledger * n) if ledger is not None else None
            out[run.name] = res
    return out


def test_ledger_slope_is_the_measured_ledger_memory_per_parameter():
    sc = scale("cpu")
    res = systems_results(sc, {"slidedp": (14.3, 14.0), "replicated": (28.3, 28.0)})
    got = tables.host_slopes(res, sc)
    assert got.total["slidedp"] == pytest.approx(14.3, abs=1e-3)
    assert got.ledger == pytest.approx({"slidedp": 14.0, "replicated": 28.0}, abs=1e-3)
    headers = got.table.headers
    rows = {row[0]: dict(zip(headers, row)) for row in got.table.rows}
    assert rows["slidedp"]["ledger slope / replicated"] == pytest.approx(0.5, abs=1e-3)
    assert rows["ddp"]["ledger slope GB per B params"] == "-"  # no ledger
    assert rows["ddp"]["slope GB per B params"] == pytest.approx(20.0, abs=1e-2)


def test_a_run_without_its_ledger_gives_no_ledger_slope():
    sc = scale("cpu")
    res = systems_results(sc, {"slidedp": (14.3, 14.0), "replicated": (28.3, 28.0)})
    res[f"systems/{sc.slope_shapes[1].name}/replicated"].ledger_host_bytes = None
    assert "replicated" not in tables.host_slopes(res, sc).ledger


def _write_rank(folder: Path, rank: int, spec, ledger: dict | None) -> None:
    n = spec.steps
    data = {
        "starts": [float(i) for i in range(n)],
        "walls": [100.0 + i for i in range(n)],
        "end_wall": 100.0 + n,
        "losses": [1.0] * n,
        "tokens": [7] * n,
        "device_memory": None,
        "device_note": "",
        "private_peak_bytes": 1,
    }
    if ledger is not None:
        data["ledger"] = ledger
    (folder / f"result_rank{rank}.json").write_text(json.dumps(data))


@pytest.mark.parametrize("system", ["slidedp", "replicated"])
def test_every_ledger_file_is_counted_once(tmp_path, system):
    sc = scale("cpu")
    spec = next(r.spec for j in plan(sc, tmp_path, init=fake_init) for r in j.runs if r.spec.system == system)
    # SlideDP: one file mapped by every rank, counted on local rank 0; replicated: a file per rank
    shared = system == "slidedp"
    for rank in range(spec.ranks):
        ledger = {
            "nbytes": 5000,
            "allocated_bytes": 4096 * (1 if shared else rank + 1),
            "counted": not shared or rank == 0,
        }
        _write_rank(tmp_path, rank, spec, ledger)
    res = RunResult("x", spec)
    sampler = Sampler(0)
    sampler.samples = [Sample(100.5, 10, 10, 5, 2, 100.6)]
    runner._collect(res, tmp_path, sampler)
    assert res.ok, res.reason
    expected = 4096 if shared else sum(4096 * (r + 1) for r in range(spec.ranks))
    assert res.ledger_host_bytes == expected and res.extra["ledger_bytes"] == 5000


def test_a_run_without_a_ledger_reports_none(tmp_path):
    spec = next(r.spec for j in plan(scale("cpu"), tmp_path, init=fake_init) for r in j.runs if r.spec.system == "ddp")
    for rank in range(spec.ranks):
        _write_rank(tmp_path, rank, spec, None)
    res = RunResult("x", spec)
    runner._collect(res, tmp_path, Sampler(0))
    assert res.ok and res.ledger_host_bytes is None and "ledger_bytes" not in res.extra


def test_a_system_without_its_bench_extra_is_not_installed_with_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(runner.NEEDS, "zero_offload", "no_such_module_for_the_bench_test")
    spec = next(
        r.spec for j in plan(scale("cpu"), tmp_path, init=fake_init) for r in j.runs if r.spec.system == "zero_offload"
    )
    (res,) = run_job([("systems/x/zero_offload", spec)], tmp_path / "job")
    assert res.status == "not installed" and BENCH_EXTRA in res.reason
    assert not (tmp_path / "job" / "output.log").exists()  # nothing was launched
    assert runner.missing_package(spec.with_(system="slidedp")) == ""


@pytest.mark.parametrize("name", SCALES)
def test_every_slidedp_knob_is_a_strategy_argument(name):
    from slidedp_lightning import SlideDPStrategy

    accepted = set(inspect.signature(SlideDPStrategy.__init__).parameters) | {"loss_chunk", "lane_trace"}
    knobs = {k for j in plan(scale(name), Path("/nonexistent"), init=fake_init) for r in j.runs for k in r.spec.knobs}
    assert knobs <= accepted, knobs - accepted
    assert {"param_route", "activation_policy", "loss_chunk", "lane_trace"} <= knobs
    assert "zero_offload" in SYSTEMS and set(runner.NEEDS) <= set(SYSTEMS)


@pytest.mark.slow  # a subprocess of its own: out of the fast tier
def test_the_loss_chunk_knob_computes_the_same_loss_in_chunks(tmp_path):
    import torch

    from bench.baselines.lit import BenchLM
    from bench.baselines.record import Recorder
    from bench.baselines.workload import init_file_for

    sc = scale("cpu")
    spec = next(r.spec for j in plan(sc, tmp_path, init=init_file_for) for r in j.runs if r.name.startswith("loss/"))
    batch = torch.randint(0, spec.model.vocab, (2, spec.seq))
    losses = []
    for chunk in (None, 8):
        module = BenchLM(spec, Recorder(tmp_path, 0), hf_checkpointing=False, fused_adamw=False, loss_chunk=chunk)
        module.configure_model()
        out = module.model(input_ids=batch, labels=batch)
        assert (out.logits is None) == (chunk is not None)  # chunked: the full logits are never made
        losses.append(out.loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
