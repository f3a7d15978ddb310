"""A traced 2-rank CPU run: TensorBoard scalars + Gantt image per rank, and a Chrome trace with every lane."""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from slidedp_lightning.runtime.trace import LANES

pytestmark = pytest.mark.slow  # multi-process jobs


@pytest.mark.integration
@pytest.mark.parametrize("grad_route, activations", [("gpu_reduce", None), ("host_reduce", "full@0.5")])
def test_traced_run_writes_tensorboard_gantt_and_chrome_trace(job_runner, tmp_path, grad_route, activations):
    trace_dir = tmp_path / "trace"
    res = job_runner(
        f"traced_{grad_route}",
        strategy="slidedp",
        devices=2,
        tied=True,
        steps=5,
        batch=4,
        grad_route=grad_route,
        param_route="sharded",
        trace_dir=str(trace_dir),
        activation_policy=activations,
    )
    assert res.returncode == 0, res.output[-3000:]
    # without activation offload lane 2 is idle; a gpu_reduce run on CPU has no device->host copy
    expected = set(LANES) if activations else set(LANES) - {"offload"} - {"d2h"}
    for rank in range(2):
        trace = json.loads((trace_dir / f"trace_rank{rank}.json").read_text())
        lanes = {e["cat"] for e in trace["traceEvents"] if e["ph"] == "X"}
        assert expected <= lanes, f"rank {rank}: lanes with spans {lanes}"
        acc = EventAccumulator(str(trace_dir / f"rank{rank}"), size_guidance={"images": 4, "scalars": 0})
        acc.Reload()
        assert "lanes/gantt" in acc.Tags()["images"]
        scalars = acc.Tags()["scalars"]
        for tag in ("step/step_time_ms", "step/exposed_host_ms", "step/overlap_fraction", "lanes/update_ms"):
            assert tag in scalars
        steps = [e.step for e in acc.Scalars("step/step_time_ms")]
        assert steps == list(range(5))
        overlap = [e.value for e in acc.Scalars("step/overlap_fraction")]
        assert all(0.0 <= v <= 1.0 for v in overlap)
