"""A traced 2-rank CPU run: TensorBoard scalars + Gantt image per rank, a Chrome trace with every lane, and spans that
cover the compute thread's whole iteration."""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from slidedp_lightning.runtime.trace import LANES, coverage

pytestmark = pytest.mark.slow  # multi-process jobs


LOOP_NAMES = {
    "model code between units",
    "loss, training step",
    "all_reduce of a logged value",
    "closure, backward to the first unit",
    "after backward: the training loop",
    "close the step",
    "training loop between steps",
}
CASES = [("gpu_reduce", None), ("host_reduce", "full@0.5")]
STEPS = 5


def _traced_job(job_runner, tmp_path_factory, grad_route: str, activations: str | None):
    """One traced 2-rank job per case, shared by the tests of this module."""
    trace_dir = tmp_path_factory.getbasetemp() / f"trace_{grad_route}"
    res = job_runner(
        f"traced_{grad_route}",
        strategy="slidedp",
        devices=2,
        tied=True,
        steps=STEPS,
        batch=4,
        grad_route=grad_route,
        param_route="sharded",
        trace_dir=str(trace_dir),
        activation_policy=activations,
    )
    assert res.returncode == 0, res.output[-3000:]
    return trace_dir


@pytest.mark.integration
@pytest.mark.parametrize("grad_route, activations", CASES)
def test_traced_run_writes_tensorboard_gantt_and_chrome_trace(job_runner, tmp_path_factory, grad_route, activations):
    trace_dir = _traced_job(job_runner, tmp_path_factory, grad_route, activations)
    # without activation offload lane 2 is idle; a gpu_reduce run on CPU has no device->host copy
    # and without the optimizer state on disk no disk lane
    expected = (set(LANES) if activations else set(LANES) - {"offload"} - {"d2h"}) - {"disk"}
    for rank in range(2):
        trace = json.loads((trace_dir / f"trace_rank{rank}.json").read_text())
        lanes = {e["cat"] for e in trace["traceEvents"] if e["ph"] == "X"}
        assert expected <= lanes, f"rank {rank}: lanes with spans {lanes}"
        acc = EventAccumulator(str(trace_dir / f"rank{rank}"), size_guidance={"images": 4, "scalars": 0})
        acc.Reload()
        assert "lanes/gantt" in acc.Tags()["images"]
        assert (trace_dir / f"gantt_rank{rank}.png").read_bytes()[:4] == b"\x89PNG"
        scalars = acc.Tags()["scalars"]
        for tag in ("step/step_time_ms", "step/exposed_host_ms", "step/overlap_fraction", "lanes/update_ms"):
            assert tag in scalars
        steps = [e.step for e in acc.Scalars("step/step_time_ms")]
        assert steps == list(range(STEPS))
        overlap = [e.value for e in acc.Scalars("step/overlap_fraction")]
        assert all(0.0 <= v <= 1.0 for v in overlap)


@pytest.mark.integration
@pytest.mark.parametrize("grad_route, activations", CASES)
def test_spans_cover_the_compute_thread(job_runner, tmp_path_factory, grad_route, activations):
    """Every part of the compute thread's iteration is on a lane or a named span: the union of its spans covers at
    least 95 % of each step's wall time (first forward to the next step's; the last step: its window), computed
    from the Chrome trace and equal to the TensorBoard scalar."""
    trace_dir = _traced_job(job_runner, tmp_path_factory, grad_route, activations)
    for rank in range(2):
        trace = json.loads((trace_dir / f"trace_rank{rank}.json").read_text())
        loop = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "loop"}
        assert LOOP_NAMES <= loop, f"rank {rank}: loop spans {loop}"
        got = coverage(trace)
        assert sorted(got) == list(range(STEPS))
        assert min(got.values()) >= 0.95, f"rank {rank}: coverage per step {got}"
        acc = EventAccumulator(str(trace_dir / f"rank{rank}"), size_guidance={"scalars": 0})
        acc.Reload()
        scalar = {e.step: e.value for e in acc.Scalars("step/coverage")}
        assert scalar == pytest.approx(got, abs=1e-6)
