"""Where lane operations run and how the other lanes wait for them: one small interface, two backends.

The runtime issues every copy and collective through a :class:`Lanes` object and never touches streams or
events itself:

- ``on(lane)``: operations issued inside run on that lane; device memory allocated inside belongs to it.
- ``mark(lane)`` -> a marker that completes once everything issued on ``lane`` so far has completed;
  ``wait(lane, marker)`` orders ``lane`` after it without blocking the host; ``host_wait(marker)`` blocks.
- ``hand_over(tensor, lane)``: ``tensor``'s device memory is used on ``lane`` too; the allocator must not
  reuse it before that work is done.
- ``to_host(piece, work)``: bring a collective's device result to the host on the D2H lane.
- ``submit(lane, fn)``: the lane's host worker thread (one per lane, in order).
- ``span(...)``/``stamp(lane)``: trace timestamps (CUDA events on the lane's stream, or the monotonic clock).

Lanes (arXiv 2609.34162, §3.3): ``compute``; ``h2d`` parameter transfer; ``offload`` activation offload/reload;
``comm`` collectives issued by the H2D lane (all-gather); ``d2h`` gradient return. The update lane (CPU
AdamW) is a host thread of its own (:mod:`update`).

:class:`CudaLanes`: one CUDA stream per lane besides ``compute`` (the current stream), events between them.
:class:`CpuLanes`: the same calls on the CPU, where a device operation is complete when the call returns;
overlap and ordering come from the worker threads, so ordering bugs surface in CPU tests as well.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch

from slidedp_lightning.runtime.trace import Tracer

log = logging.getLogger(__name__)

STREAM_LANES = ("h2d", "d2h", "comm", "offload")
WORKER_LANES = ("h2d", "d2h", "offload")
_NULL = nullcontext()


class CollectiveHandle(Protocol):
    """A pending collective: ``torch.distributed.Work``, or one the runtime issues later on a lane thread."""

    def wait(self) -> object:
        """Block until it has completed (raising its error)."""

    def is_completed(self) -> bool:
        """Whether it has completed (never blocks)."""


class Lanes:
    """Lane executors of one engine (see the module docstring); created by :func:`make_lanes`."""

    def __init__(self, device: torch.device, tracer: Tracer | None = None) -> None:
        self.device = device
        self.tracer = tracer or Tracer(None, 0)
        self._workers = {
            lane: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"slidedp-{lane}") for lane in WORKER_LANES
        }
        for worker in self._workers.values():  # each thread starts now, not inside the first step's first acquire
            worker.submit(int).result()

    # -- device work (overridden by the CUDA backend) -------------------------------------------------
    def on(self, lane: str) -> AbstractContextManager:
        return _NULL

    def mark(self, lane: str):
        return None

    def wait(self, lane: str, marker) -> None:
        pass

    def host_wait(self, marker) -> None:
        pass

    def done(self, marker) -> bool:
        """Whether ``marker`` has completed (never blocks)."""
        return True

    def hand_over(self, tensor: torch.Tensor, lane: str) -> None:
        pass

    def drain(self, timeout_s: float | None = None) -> bool:
        """Block until every device operation issued so far on any lane has completed (before host memory that
        copies read or write is rewritten, unpinned or unmapped); with ``timeout_s``, for at most that long (after
        an error a collective may wait for a dead peer forever). Returns whether everything completed."""
        return True

    def to_host(
        self, piece: torch.Tensor, work: CollectiveHandle | None
    ) -> tuple[torch.Tensor, object, CollectiveHandle | None]:
        """``(host tensor, marker, work)``: the host copy of ``piece`` once ``marker`` and then ``work``
        (a pending collective handle, or None) are waited for."""
        return piece, None, work

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def stamp(self, lane: str):
        """A trace timestamp on ``lane`` (seconds on the host's monotonic clock, or a timing event)."""
        return time.perf_counter()

    def is_stream(self, lane: str) -> bool:
        return False

    # -- host work -----------------------------------------------------------------------------------
    def submit(self, lane: str, fn, *args) -> Future:
        return self._workers[lane].submit(fn, *args)

    def span(
        self, lane: str, name: str, step: int, unit: int = -1, chunk: int = -1, on: str | None = None
    ) -> AbstractContextManager:
        """Trace the operations issued inside as one span of trace lane ``lane``, timed on lane ``on``
        (default ``lane``; host clock for lanes without a stream). A shared no-op when tracing is off."""
        if not self.tracer.enabled:
            return _NULL
        return _LaneSpan(self, lane, on or lane, name, step, unit, chunk)

    def close(self, wait: bool = True) -> None:
        """Stop the worker threads (after an error, without waiting on work that may wait for a dead peer)."""
        for worker in self._workers.values():
            worker.shutdown(wait=wait, cancel_futures=True)


class CpuLanes(Lanes):
    """The CPU backend: device operations run inline on the calling lane thread."""


class CudaLanes(Lanes):
    """The CUDA backend: a stream per lane, events between lanes, timing events for traces."""

    def __init__(self, device: torch.device, tracer: Tracer | None = None) -> None:
        super().__init__(device, tracer)
        # the compute lane is the stream current when the engine is made (the device's default stream under
        # Lightning and plain loops; autograd runs backward on the forward's stream). Held here, not looked up:
        # inside ``on(lane)`` the current stream is that lane's, and "after compute" must still mean compute.
        self.compute = torch.cuda.current_stream(device)
        self.streams = {lane: torch.cuda.Stream(device) for lane in STREAM_LANES}
        if self.tracer.enabled:
            # one timing event taken while the device is idle ties device timestamps to the host clock
            torch.cuda.synchronize(device)
            ref = torch.cuda.Event(enable_timing=True)
            ref.record(self.compute)
            ref.synchronize()
            self.tracer.set_device_clock(ref, time.perf_counter())

    def _stream(self, lane: str) -> torch.cuda.Stream:
        return self.compute if lane == "compute" else self.streams[lane]

    def on(self, lane: str) -> AbstractContextManager:
        return torch.cuda.stream(self._stream(lane))

    def mark(self, lane: str) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self._stream(lane))
        return event

    def wait(self, lane: str, marker) -> None:
        if marker is not None:
            self._stream(lane).wait_event(marker)

    def host_wait(self, marker) -> None:
        if marker is not None:
            marker.synchronize()

    def done(self, marker) -> bool:
        return marker is None or marker.query()

    def hand_over(self, tensor: torch.Tensor, lane: str) -> None:
        tensor.record_stream(self._stream(lane))

    def drain(self, timeout_s: float | None = None) -> bool:
        if timeout_s is None:
            torch.cuda.synchronize(self.device)
            return True
        events = []
        for stream in (self.compute, *self.streams.values()):
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        deadline = time.monotonic() + timeout_s
        while not all(e.query() for e in events):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def to_host(
        self, piece: torch.Tensor, work: CollectiveHandle | None
    ) -> tuple[torch.Tensor, object, CollectiveHandle | None]:
        host = self.pinned(piece.numel(), piece.dtype)
        with self.on("d2h"):
            if work is not None:
                work.wait()  # the D2H stream (not the compute stream) waits for the collective
            else:
                self.wait("d2h", self.mark("compute"))
            host.copy_(piece, non_blocking=True)
            marker = self.mark("d2h")
        self.hand_over(piece, "d2h")
        return host, marker, None

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def is_stream(self, lane: str) -> bool:
        return lane == "compute" or lane in self.streams

    def stamp(self, lane: str):
        if not self.is_stream(lane):
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(self._stream(lane))
        return event


def make_lanes(device: torch.device, tracer: Tracer | None = None) -> Lanes:
    """The backend for ``device``: :class:`CudaLanes` on CUDA, :class:`CpuLanes` otherwise."""
    backend = CudaLanes if device.type == "cuda" else CpuLanes
    log.debug("SlideDP lanes: %s on %s", backend.__name__, device)
    return backend(device, tracer)


class _LaneSpan:
    __slots__ = ("lanes", "lane", "clock", "name", "step", "unit", "chunk", "start")

    def __init__(self, lanes: Lanes, lane: str, clock: str, name: str, step: int, unit: int, chunk: int) -> None:
        self.lanes, self.lane, self.clock, self.name = lanes, lane, clock, name
        self.step, self.unit, self.chunk = step, unit, chunk

    def __enter__(self) -> None:
        self.start = self.lanes.stamp(self.clock)

    def __exit__(self, *exc) -> None:
        end = self.lanes.stamp(self.clock)
        self.lanes.tracer.record(self.lane, self.name, self.step, self.start, end, self.unit, self.chunk)
