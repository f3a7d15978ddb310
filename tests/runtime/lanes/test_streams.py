"""The lane backends: one interface, inline CPU operations or CUDA streams and events."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from slidedp_lightning.runtime.lanes.streams import CpuLanes, CudaLanes, make_lanes
from slidedp_lightning.runtime.trace import Tracer


def test_cpu_backend_is_chosen_for_cpu_and_runs_device_work_inline():
    lanes = make_lanes(torch.device("cpu"))
    try:
        assert isinstance(lanes, CpuLanes)
        src, dst = torch.arange(8.0), torch.zeros(8)
        with lanes.on("h2d"):
            dst.copy_(src, non_blocking=True)
        marker = lanes.mark("h2d")
        assert lanes.done(marker)
        lanes.wait("compute", marker)
        lanes.host_wait(marker)
        assert torch.equal(dst, src)  # complete when the call returned
        host, marker, work = lanes.to_host(src, "pending-collective")
        assert host is src and work == "pending-collective", "on the CPU the update lane waits for the collective"
    finally:
        lanes.close()


def test_each_worker_lane_is_one_thread_running_its_work_in_order():
    lanes = make_lanes(torch.device("cpu"))
    seen: list[tuple[str, int]] = []

    def work(i: int) -> str:
        time.sleep(0.002 * (5 - i))  # later submissions finish faster if they ran concurrently
        seen.append((threading.current_thread().name, i))
        return threading.current_thread().name

    try:
        h2d = [lanes.submit("h2d", work, i) for i in range(5)]
        names = {f.result() for f in h2d}
        assert [i for _, i in seen] == list(range(5))
        assert len(names) == 1 and names.pop().startswith("slidedp-h2d")
        assert lanes.submit("d2h", work, 0).result().startswith("slidedp-d2h")
    finally:
        lanes.close()


def test_close_without_waiting_cancels_queued_work():
    lanes = make_lanes(torch.device("cpu"))
    gate, running = threading.Event(), threading.Event()
    first = lanes.submit("h2d", lambda: running.set() or gate.wait(5.0))
    assert running.wait(5.0)  # the lane's thread holds the first item: the second stays queued
    queued = lanes.submit("h2d", lambda: None)
    lanes.close(wait=False)
    assert queued.cancelled()
    gate.set()
    first.result(timeout=5)


def test_spans_are_free_when_tracing_is_off_and_timed_on_the_host_clock_on_cpu(tmp_path):
    off = make_lanes(torch.device("cpu"))
    assert off.span("h2d", "copy", 0) is off.span("d2h", "copy", 1)  # the shared null context
    off.close()
    tracer = Tracer(str(tmp_path), rank=0)
    lanes = make_lanes(torch.device("cpu"), tracer)
    with lanes.span("h2d", "all_gather", step=3, unit=1, chunk=2, on="comm"):
        time.sleep(0.001)
    lanes.close()
    (span,) = tracer.spans
    assert (span.lane, span.name, span.step, span.unit, span.chunk) == ("h2d", "all_gather", 3, 1, 2)
    assert isinstance(span.start, float) and span.end - span.start >= 0.001


class FakeEvent:
    """A timing event that completed ``ms`` after the reference event."""

    def __init__(self, ms: float) -> None:
        self.ms = ms
        self.synced = False

    def synchronize(self) -> None:
        self.synced = True

    def elapsed_time(self, other: FakeEvent) -> float:
        return other.ms - self.ms


def test_device_timing_events_are_placed_on_the_host_clock_when_a_step_is_written(tmp_path):
    tracer = Tracer(str(tmp_path), rank=0, gantt_step=-1)
    tracer.set_device_clock(FakeEvent(0.0), host_seconds=100.0)
    start, end = FakeEvent(5.0), FakeEvent(12.5)
    tracer.record("compute", "forward", 0, start, end, unit=0)
    tracer.record("update", "adamw", 0, 100.004, 100.010, unit=0)  # host-clock spans mix with device spans
    tracer.mark_step(0, 100.0, 100.020)
    tracer.mark_step(1, 100.020, 100.030)  # step 0 is complete: written now
    assert start.synced and end.synced, "events are synchronized before their times are read"
    m = tracer.metrics[0]
    assert m["busy_compute"] == pytest.approx(0.0075)
    assert m["busy_update"] == pytest.approx(0.006)
    events = [e for e in tracer.chrome_trace()["traceEvents"] if e["ph"] == "X" and e["cat"] == "compute"]
    assert events[0]["dur"] == pytest.approx(7500.0)
    tracer.close()


@pytest.fixture
def cuda_lanes():
    """CUDA lanes on GPU 0 (a ``gpu`` test: skipped without one), closed after the test."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    lanes = make_lanes(torch.device("cuda", 0))
    yield lanes
    lanes.close()


@pytest.mark.gpu
def test_cuda_backend_orders_copies_and_collective_results_through_events(cuda_lanes):
    lanes = cuda_lanes
    assert isinstance(lanes, CudaLanes)
    src = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    with lanes.on("h2d"):
        buf = torch.empty_like(src, device=lanes.device)
        buf.copy_(src, non_blocking=True)
    lanes.wait("compute", lanes.mark("h2d"))
    doubled = buf * 2  # on the compute stream, after the copy
    host, marker, work = lanes.to_host(doubled, None)
    assert work is None and host.is_pinned()
    lanes.host_wait(marker)
    assert lanes.done(marker)
    assert torch.equal(host, src * 2)


@pytest.mark.gpu
def test_cuda_copies_issued_on_another_lane_wait_for_the_compute_stream(cuda_lanes):
    """A gradient's return without a collective (one rank) and an activation offload are issued inside another
    lane's stream context while the compute stream may still be writing their source: "after compute" must mean
    the compute stream, not the stream current at that moment."""
    lanes = cuda_lanes
    x = torch.randn(1 << 22, device=lanes.device)
    expected = (x * 2).cpu()
    for route in ("to_host", "offload"):
        torch.cuda.synchronize(lanes.device)
        torch.cuda._sleep(100_000_000)  # the compute stream is busy for tens of milliseconds
        y = x * 2  # queued behind the sleep
        if route == "to_host":
            host, marker, _ = lanes.to_host(y, None)
        else:  # runtime.lanes.activations' offload: ordered after compute, from inside the offload lane
            host = lanes.pinned(y.numel(), y.dtype)
            with lanes.on("offload"):
                lanes.wait("offload", lanes.mark("compute"))
                host.copy_(y, non_blocking=True)
                marker = lanes.mark("offload")
        lanes.host_wait(marker)
        assert torch.equal(host, expected), f"{route}: the copy ran before the compute stream wrote its source"


@pytest.mark.gpu
def test_a_bounded_drain_reports_work_still_running_and_a_full_one_waits(cuda_lanes):
    lanes = cuda_lanes
    assert lanes.drain(timeout_s=1.0)  # idle
    with lanes.on("h2d"):
        torch.cuda._sleep(2_000_000_000)  # about a second of device time on one lane's stream
    assert not lanes.drain(timeout_s=0.01)
    assert lanes.drain() and lanes.drain(timeout_s=0.01)
