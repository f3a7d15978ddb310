"""Lane-trace arithmetic: busy time, exposed host time, overlap fraction, coverage of the compute thread; Chrome
trace and Gantt outputs; off = no-op."""

from __future__ import annotations

import json

import pytest

from slidedp_lightning.runtime.trace import LANES, ROWS, Span, Tracer, coverage, on_compute_thread, step_metrics


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


def test_loop_spans_are_the_compute_thread_not_host_work():
    spans = [_span("compute", 0.0, 4.0), _span("loop", 4.0, 6.0), _span("update", 5.0, 6.0)]
    m = step_metrics(spans, start=0.0, end=8.0)
    assert m["busy_loop"] == 2.0
    assert m["overlap_fraction"] == 0.0  # the update ran under loop time, not under compute
    assert m["coverage"] == 6.0 / 8.0  # compute + loop; the update lane is another thread
    assert on_compute_thread("reduce", "issue") and not on_compute_thread("reduce", "reduce + return")


def test_coverage_of_an_iteration_counts_the_next_steps_early_spans():
    """The wall time runs to the next step's first forward; a span recorded under the next step that lies before
    it (a validation wait between the steps) counts, its part after the next start does not."""
    this = [_span("compute", 0.0, 5.0), _span("loop", 6.0, 7.0)]  # the step closes at 6
    later = [Span("stall", "wait h2d", 1, 0, -1, 7.0, 8.5)]  # 8..8.5 is past the next start
    m = step_metrics(this, start=0.0, end=6.0, next_start=8.0, neighbours=later)
    assert m["iteration_time"] == 8.0 and m["step_time"] == 6.0
    assert m["coverage"] == pytest.approx(7.0 / 8.0)
    assert m["busy_stall"] == 0.0  # busy times count this step's own spans
    assert "iteration_time" not in step_metrics(this, 0.0, 6.0)


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
    assert names == set(ROWS) | {"steps"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in spans} == set(LANES) | {"step"}
    assert all(e["pid"] == 3 and e["dur"] >= 0 for e in spans)
    (window,) = [e for e in spans if e["cat"] == "step"]
    assert window["name"] == "step 0" and window["dur"] == pytest.approx(1e6)


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


def test_coverage_from_the_chrome_trace_matches_the_scalars(tmp_path):
    """Three steps of 10 ms: compute, a stall, the issue of a gradient and loop spans cover the compute thread but
    for a known hole per step; the update lane's span is another thread and covers nothing."""
    t = Tracer(str(tmp_path), rank=0, gantt_step=1)
    o = t.origin
    holes = [0.001, 0.002, 0.0005]
    for k, hole in enumerate(holes):
        s = o + 0.010 * k
        t.record("compute", "forward", k, s, s + 0.003)
        t.record("stall", "wait h2d", k, s + 0.003, s + 0.004)
        t.record("compute", "backward", k, s + 0.004 + hole, s + 0.007)
        t.record("reduce", "issue", k, s + 0.006, s + 0.0075)
        t.record("update", "adamw", k, s + 0.001, s + 0.0095)
        t.record("loop", "training loop between steps", k, s + 0.0075, s + 0.010)
        t.mark_step(k, s, s + 0.0075)
    t.close()
    got = coverage(json.loads((tmp_path / "trace_rank0.json").read_text()))
    # steps 0 and 1: iterations of 10 ms; the last step: its window (7.5 ms), its loop span past it not counted
    want = {0: 1 - holes[0] / 0.010, 1: 1 - holes[1] / 0.010, 2: 1 - holes[2] / 0.0075}
    assert got == pytest.approx(want)
    assert {k: m["coverage"] for k, m in t.metrics.items()} == pytest.approx(want)
    assert t.metrics[0]["iteration_time"] == pytest.approx(0.010) and "iteration_time" not in t.metrics[2]


def test_gantt_png_is_written_at_close(tmp_path):
    t = Tracer(str(tmp_path), rank=1, gantt_step=0)
    o = t.origin
    t.record("compute", "forward", 0, o, o + 0.002)
    t.record("loop", "loss, training step", 0, o + 0.002, o + 0.004)
    t.record("loop", "all_reduce of a logged value", 0, o + 0.003, o + 0.004)
    t.mark_step(0, o, o + 0.004)
    t.close()
    png = tmp_path / "gantt_rank1.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
