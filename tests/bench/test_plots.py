"""The plots are drawn from the recorded results (results.json), and only from what finished."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import plots
from bench.baselines.runner import RunResult
from bench.configs import plan, scale

GB = 1e9


def fake_init(shape, seq: int, root: Path) -> Path:
    return root / f"init-{shape.name}-{seq}.pt"


def recorded(tmp_path: Path, trace: Path | None = None) -> dict[str, dict]:
    """results.json's runs of a quick plan: systems ok (host 1 GB + 14 B/param for SlideDP, 20 for the others), the
    loss runs ok, zero_offload not installed."""
    runs = {}
    for job in plan(scale("cpu", fast=True), tmp_path, init=fake_init):
        for run in job.runs:
            spec, n = run.spec, run.spec.model.num_params
            if spec.system == "zero_offload":
                runs[run.name] = RunResult(run.name, spec, "not installed", "not installed: ...").summary()
                continue
            r = RunResult(run.name, spec, step_s=[0.5, 0.5], losses=[3.0 - 0.01 * i for i in range(spec.steps)])
            r.host_peak = int(GB + (14 if spec.system == "slidedp" else 20) * n)
            if run.name.startswith("loss/") and spec.system == "fsdp2":
                r.losses = [x + 1e-5 for x in r.losses]
            if trace is not None and run.name.startswith("trace/"):
                r.extra["lane_trace"] = str(trace)
            runs[run.name] = r.summary()
    return runs


def chrome_trace() -> dict:
    events = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "h2d"}}]
    for step in range(4):
        base = step * 1e6
        for lane, t, dur in (("h2d", 0, 2e5), ("compute", 1e5, 6e5), ("update", 5e5, 3e5)):
            args = {"step": step, "unit": 0, "chunk": -1}
            events.append({"name": lane, "cat": lane, "ph": "X", "pid": 0, "tid": 0, "ts": base + t, "dur": dur,
                           "args": args})  # fmt: skip
    return {"traceEvents": events}


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_every_plot_is_written_from_results_json(tmp_path):
    trace = tmp_path / "trace_rank0.json"
    trace.write_text(json.dumps(chrome_trace()))
    (tmp_path / "results.json").write_text(json.dumps({"runs": recorded(tmp_path, trace)}))
    written = plots.write_plots(tmp_path)
    assert [p.name for p in written] == ["throughput.png", "host_memory.png", "loss.png", "lanes_gantt.png"]
    assert all(p.parent == tmp_path / "plots" and is_png(p) for p in written)


def test_the_plotted_series_are_the_recorded_values(tmp_path):
    runs = recorded(tmp_path)
    tp = plots.throughput_series(runs)
    assert "zero_offload" not in tp  # not installed: not drawn
    assert [len(v) for v in tp.values()] == [3, 3, 2, 2, 2]  # SlideDP and replicated at the slope's third size
    small = scale("cpu", fast=True).slope_shapes[0]
    assert tp["ddp"][0] == pytest.approx((small.num_params / 1e6, 2 * 32 / 0.5))  # M params, batch x seq / step
    host = plots.host_series(runs)
    assert host["slidedp"][2] == pytest.approx(14.0, rel=1e-6) and host["ddp"][2] == pytest.approx(20.0, rel=1e-6)
    assert host["slidedp"][3] == pytest.approx(1.0, rel=1e-6)  # the intercept
    loss = plots.loss_series(runs)
    assert set(loss) == {"32-true", "bf16-mixed"}
    assert loss["32-true"]["fsdp2"][0] == pytest.approx(3.0 + 1e-5)


def test_a_gantt_shows_one_step_of_the_trace():
    spans, start, end, step = plots.gantt_spans(chrome_trace())
    assert step == 2 and {s.lane for s in spans} == {"h2d", "compute", "update"}
    assert (start, end) == pytest.approx((2.1, 2.7))  # the step's compute spans, seconds
    trace = chrome_trace()  # a trace with the step windows: they bound the step
    window = {"name": "step 2", "cat": "step", "ph": "X", "pid": 0, "tid": 8, "ts": 2.05e6, "dur": 0.8e6}
    trace["traceEvents"].append({**window, "args": {"step": 2}})
    spans, start, end, _ = plots.gantt_spans(trace)
    assert (start, end) == pytest.approx((2.05, 2.85)) and "step" not in {s.lane for s in spans}


def test_nothing_finished_draws_nothing(tmp_path):
    runs = {k: {**v, "status": "not run"} for k, v in recorded(tmp_path).items()}
    assert plots.write_plots(tmp_path, runs) == []
