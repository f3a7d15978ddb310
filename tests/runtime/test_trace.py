"""Lane-trace arithmetic: busy time, exposed host time, overlap fraction; Chrome trace shape; off = no-op."""

from __future__ import annotations

import json

from slidedp_lightning.runtime.trace import LANES, ROWS, Span, Tracer, step_metrics


def _span(lane: str, a: float, b: float) -> Span:
    return Span(lane, "op", 0, 0, -1, a, b)


def test_step_metrics_unions_and_overlap():
    spans = [
        _span("compute", 0.0, 4.0),
        _span("compute", 3.0, 6.0),  # union 0..6
        _span("h2d", 5.0, 7.0),  # 1 s under compute, 1 s exposed
        _span("update", 7.0, 9.0),  # fully exposed
        _span("stall", 6.0, 6.5),
    ]
    m = step_metrics(spans, start=0.0, end=10.0)
    assert m["busy_compute"] == 6.0
    assert m["busy_h2d"] == 2.0 and m["busy_update"] == 2.0 and m["busy_offload"] == 0.0
    assert m["busy_stall"] == 0.5
    assert m["step_time"] == 10.0
    assert m["exposed_host"] == 4.0  # step time - compute
    assert m["overlap_fraction"] == 1.0 / 4.0  # 1 s of 4 s host work ran under compute


def test_no_host_work_counts_as_fully_overlapped():
    assert step_metrics([_span("compute", 0, 1)], 0, 1)["overlap_fraction"] == 1.0


def test_disabled_tracer_records_nothing(tmp_path):
    t = Tracer(None, rank=0)
    with t.span("h2d", "copy", 0, 1):
        pass
    t.record("update", "adamw", 0, 0.0, 1.0)
    t.mark_step(0, 0.0, 1.0)
    t.close()
    assert t.spans == [] and not list(tmp_path.iterdir())


def test_chrome_trace_has_a_named_row_per_lane(tmp_path):
    t = Tracer(str(tmp_path), rank=3)
    for lane in LANES:
        with t.span(lane, f"{lane} op", 0, 1):
            pass
    t.mark_step(0, t.origin, t.origin + 1.0)
    t.close()
    trace = json.loads((tmp_path / "trace_rank3.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == set(ROWS)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in spans} == set(LANES)
    assert all(e["pid"] == 3 and e["dur"] >= 0 for e in spans)


def test_cpu_time_per_step(tmp_path):
    """From the second step on, each step records the CPU the process and the calling (compute) thread used since
    the previous one: a busy other thread shows in the process's time only."""
    import threading
    import time

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    t = Tracer(str(tmp_path), 0)
    t.mark_step(0, 0.0, 1.0)
    other = threading.Thread(target=spin, args=(0.15,))
    other.start()
    other.join()
    spin(0.05)
    t.mark_step(1, 1.0, 2.0)
    t.mark_step(2, 2.0, 3.0)  # writes step 1
    t.close()
    assert "cpu_process" not in t.metrics[0]
    m = t.metrics[1]
    assert m["cpu_compute_thread"] >= 0.05 and m["cpu_process"] - m["cpu_compute_thread"] >= 0.14
