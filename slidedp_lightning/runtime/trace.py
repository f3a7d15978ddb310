"""Lane spans -> TensorBoard scalars per step, a Gantt figure of one step, and a Chrome/Perfetto trace.

Lanes (arXiv 2609.34162, §3.3): ``h2d`` parameter preparation + host->device, ``offload`` activation offload /
reload, ``compute`` forward/backward of a unit, ``reduce`` gradient reduction, ``d2h`` gradient return,
``update`` CPU optimizer, ``disk`` the reads and writes of the optimizer state on a local disk (its I/O threads,
with ``StateOnDisk``). Two rows are not lanes: ``stall``, the compute thread waiting on another lane (exposed
work), and ``loop``, the compute thread outside the units (model code between them, the loss and the training
step, the training loop between steps; ``docs/step.md``, "Lane traces"). A span's ends are ``time.perf_counter``
seconds, or on CUDA timing events recorded on the lane's stream, turned into the same clock when the step is
written. With tracing off every call is a no-op on a shared null context.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slidedp_lightning.intervals import merge_intervals

log = logging.getLogger(__name__)

LANES = ("h2d", "offload", "compute", "reduce", "d2h", "update", "disk")
ROWS = LANES + ("stall", "loop")
NOT_HOST = ("compute", "stall", "loop")  # rows that are the compute thread's own time, not host lanes
STEP_ROW = len(ROWS)  # the Chrome trace's row of step windows
_NULL = nullcontext()


def on_compute_thread(lane: str, name: str) -> bool:
    """Whether a span of ``lane`` named ``name`` is the compute thread's time: its compute, stalls and loop spans,
    and the issue of each unit's gradient (recorded on the reduce lane, run by the compute thread)."""
    return lane in NOT_HOST or (lane == "reduce" and name == "issue")


@dataclass(frozen=True)
class Span:
    lane: str
    name: str
    step: int
    unit: int
    chunk: int
    start: float  # or, until resolved, a device timing event (see Tracer.set_device_clock)
    end: float
    nbytes: int = 0  # the bytes it moved, where the lane counts them (the disk lane's reads and writes)


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def covered(intervals: list[tuple[float, float]], start: float, stop: float) -> float:
    """The fraction of ``[start, stop)`` that the union of ``intervals`` covers (1.0 for an empty window)."""
    if stop <= start:
        return 1.0
    return _intersection(merge_intervals(intervals), [(start, stop)]) / (stop - start)


def step_metrics(
    spans: list[Span], start: float, end: float, next_start: float | None = None, neighbours: Iterable[Span] = ()
) -> dict[str, float]:
    """Busy time per row, step time, exposed host time and the overlap fraction of one step's ``spans``
    (seconds), and ``coverage``: the fraction of the step's wall time on the compute thread that compute-thread
    spans cover. The wall time is the iteration, from this step's first forward to the next one's
    (``next_start``, also given as ``iteration_time``), or the step window ``[start, end]`` when no step follows;
    ``neighbours`` (the spans of the steps before and after) count for the coverage where they fall inside it (the
    loop between two steps is recorded under the earlier one, a validation pass's waits under the later one)."""
    lanes = defaultdict(list)
    for s in spans:
        lanes[s.lane].append((s.start, s.end))
    busy = {lane: merge_intervals(iv) for lane, iv in lanes.items()}
    compute = busy.get("compute", [])
    host = merge_intervals([iv for lane, ivs in busy.items() if lane not in NOT_HOST for iv in ivs])
    host_busy = _length(host)
    step_time = end - start
    out = {f"busy_{lane}": _length(busy.get(lane, [])) for lane in ROWS}
    thread = [(s.start, s.end) for s in (*spans, *neighbours) if on_compute_thread(s.lane, s.name)]
    out.update(
        step_time=step_time,
        exposed_host=max(0.0, step_time - _length(compute)),
        overlap_fraction=_intersection(host, compute) / host_busy if host_busy else 1.0,
        coverage=covered(thread, start, end if next_start is None else next_start),
    )
    if next_start is not None:
        out["iteration_time"] = next_start - start
    return out


def coverage(trace: dict) -> dict[int, float]:
    """Step -> the fraction of its wall time on the compute thread that the compute thread's spans cover, from a
    Chrome trace as :meth:`Tracer.chrome_trace` writes it (``trace_rank{r}.json``). The wall time of a step runs
    from its first forward to the next step's (the training loop between them included); the last step's is its
    window (first forward to the step's close)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    windows = sorted((e["ts"], e["ts"] + e["dur"], e["args"]["step"]) for e in events if e["cat"] == "step")
    thread = merge_intervals([(e["ts"], e["ts"] + e["dur"]) for e in events if on_compute_thread(e["cat"], e["name"])])
    out = {}
    for i, (start, end, step) in enumerate(windows):
        stop = windows[i + 1][0] if i + 1 < len(windows) else end
        out[step] = _intersection(thread, [(start, stop)]) / (stop - start) if stop > start else 1.0
    return out


class Tracer:
    """Collects spans of one rank; writes them when a step is complete and at close."""

    def __init__(self, trace_dir: str | None, rank: int, gantt_step: int = 2) -> None:
        self.enabled = trace_dir is not None
        self.rank = rank
        self.dir = Path(trace_dir) if trace_dir else None
        self.gantt_step = gantt_step
        self.spans: list[Span] = []
        self._by_step: dict[int, list[Span]] = {}  # the same spans, by step
        self._bounds: dict[int, list[float]] = {}
        self._written: set[int] = set()
        self.metrics: dict[int, dict[str, float]] = {}  # step -> step_metrics(), in seconds
        self._lock = threading.Lock()
        self._writer: Any = None  # a SummaryWriter, made at the first step written
        self._gantt: tuple[list[Span], float, float, float | None] | None = None  # drawn at close
        self.origin = time.perf_counter()
        self._clock: tuple[Any, float] | None = (
            None  # (timing event, host seconds when it completed): maps device events to host time
        )
        self._cpu: tuple[float, float] | None = None  # (process, compute thread) CPU seconds at the last mark_step
        self._cpu_used: dict[int, tuple[float, float]] = {}  # step -> CPU seconds since the mark before it

    def set_device_clock(self, ref_event, host_seconds: float) -> None:
        """Device spans are timing events; ``ref_event`` completed at ``host_seconds`` on the host clock."""
        self._clock = (ref_event, host_seconds)

    def _seconds(self, t) -> float:
        if isinstance(t, float):
            return t
        assert self._clock is not None, "a device span needs set_device_clock() first"
        ref, host = self._clock
        t.synchronize()
        return host + ref.elapsed_time(t) / 1e3

    def _resolved(self, s: Span) -> Span:
        if isinstance(s.start, float) and isinstance(s.end, float):
            return s
        return Span(s.lane, s.name, s.step, s.unit, s.chunk, self._seconds(s.start), self._seconds(s.end), s.nbytes)

    # -- recording -------------------------------------------------------------------------------
    def span(self, lane: str, name: str, step: int, unit: int = -1, chunk: int = -1):
        """Context manager timing one lane operation (a shared no-op when tracing is off)."""
        if not self.enabled:
            return _NULL
        return _SpanContext(self, lane, name, step, unit, chunk)

    def record(self, lane: str, name: str, step: int, start, end, unit: int = -1, chunk: int = -1, nbytes: int = 0):
        """One span; ``start``/``end`` are host seconds or device timing events (see set_device_clock)."""
        if self.enabled:
            span = Span(lane, name, step, unit, chunk, start, end, nbytes)
            self.spans.append(span)  # list.append and dict.setdefault are atomic
            self._by_step.setdefault(step, []).append(span)

    def mark_step(self, step: int, start: float, end: float) -> None:
        """The compute thread's window of ``step`` (called on the compute thread); steps before it are complete and
        get written. Also records the CPU time the process and this thread used since the previous call (one
        iteration: ``cpu_process``, ``cpu_compute_thread``)."""
        if not self.enabled:
            return
        self._bounds[step] = [start, end]
        cpu = (time.process_time(), time.thread_time())
        if self._cpu is not None:
            self._cpu_used[step] = (cpu[0] - self._cpu[0], cpu[1] - self._cpu[1])
        self._cpu = cpu
        for done in sorted(s for s in self._bounds if s < step and s not in self._written):
            self._write_step(done)

    # -- output ----------------------------------------------------------------------------------
    def _tb(self) -> Any:
        assert self.dir is not None
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # a queue that holds many steps' scalars: adding one never waits for the writer thread
            self._writer = SummaryWriter(str(self.dir / f"rank{self.rank}"), max_queue=4096)
        return self._writer

    def _spans_of(self, step: int) -> list[Span]:
        return [self._resolved(s) for s in list(self._by_step.get(step, ()))]

    def _write_step(self, step: int) -> None:
        with self._lock:
            self._written.add(step)
            start, end = self._bounds[step]
            following = self._bounds.get(step + 1)
            next_start = following[0] if following else None
            spans = self._spans_of(step)
            later = [s for s in self._spans_of(step + 1) if next_start is not None and s.start < next_start]
            earlier = [s for s in self._spans_of(step - 1) if s.end > start]
            metrics = step_metrics(spans, start, end, next_start, earlier + later)
            if step in self._cpu_used:
                metrics["cpu_process"], metrics["cpu_compute_thread"] = self._cpu_used[step]
            self.metrics[step] = metrics
            writer = self._tb()
            for key, value in metrics.items():
                scale = 1.0 if key in ("overlap_fraction", "coverage") else 1e3
                tag = (
                    f"lanes/{key[5:]}_ms" if key.startswith("busy_") else f"step/{key}" + ("" if scale == 1 else "_ms")
                )
                writer.add_scalar(tag, value * scale, step)
            if step == self.gantt_step:
                self._gantt = (earlier + spans + later, start, end, next_start)

    def gantt(self, spans: list[Span], start: float, end: float, step: int, next_start: float | None = None):
        """A matplotlib figure of ``spans``, one row per lane (``loop`` spans coloured by name), from the step's
        first forward to the next step's (``next_start``) or to the step's close."""
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt

        fig, ax = plt.subplots(figsize=(12, 4.2))
        colors = plt.get_cmap("tab10")
        for row, lane in enumerate(ROWS[:-1]):
            bars = [((s.start - start) * 1e3, (s.end - s.start) * 1e3) for s in spans if s.lane == lane]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colors(row))
        loop_row = len(ROWS) - 1
        loop = sorted((s for s in spans if s.lane == "loop"), key=lambda s: s.start - s.end)  # nested ones on top
        names = sorted({s.name for s in loop})
        shades = plt.get_cmap("tab20")
        labelled: set[str] = set()
        for s in loop:
            bar = [((s.start - start) * 1e3, (s.end - s.start) * 1e3)]
            label = None if s.name in labelled else s.name
            ax.broken_barh(bar, (loop_row - 0.4, 0.8), facecolors=shades(names.index(s.name) % 20), label=label)
            labelled.add(s.name)
        labels = {"stall": "compute waits", "loop": "outside units"}
        ax.set_yticks(
            range(len(ROWS)), [f"{i + 1} {lane}" if lane in LANES else labels[lane] for i, lane in enumerate(ROWS)]
        )
        ax.invert_yaxis()
        ax.axvline((end - start) * 1e3, color="k", lw=0.8, ls="--")
        stop = end
        if next_start is not None:
            stop = next_start
            ax.axvline((next_start - start) * 1e3, color="k", lw=0.8, ls=":")
        thread = [(s.start, s.end) for s in spans if on_compute_thread(s.lane, s.name)]
        ax.set_xlim(-0.01 * (stop - start) * 1e3, 1.01 * (stop - start) * 1e3)
        ax.set_xlabel(
            "ms since the step's first forward (dashed: the step's close; dotted: the next step's first forward)"
        )
        ax.set_title(
            f"SlideDP lanes, rank {self.rank}, step {step}: "
            f"{covered(thread, start, stop):.1%} of {(stop - start) * 1e3:.1f} ms on the compute thread traced"
        )
        if names:
            ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="outside units")
        fig.tight_layout()
        return fig

    def chrome_trace(self) -> dict:
        """The spans as Chrome trace events, one row per lane, and each step's window (first forward to the
        step's close) on a row of its own."""
        events = []
        for tid, lane in enumerate((*ROWS, "steps")):
            events.append({"ph": "M", "name": "thread_name", "pid": self.rank, "tid": tid, "args": {"name": lane}})
        for step, (start, end) in sorted(self._bounds.items()):
            events.append(
                {
                    "name": f"step {step}",
                    "cat": "step",
                    "ph": "X",
                    "pid": self.rank,
                    "tid": STEP_ROW,
                    "ts": (start - self.origin) * 1e6,
                    "dur": (end - start) * 1e6,
                    "args": {"step": step},
                }
            )
        for s in map(self._resolved, self.spans):
            events.append(
                {
                    "name": s.name,
                    "cat": s.lane,
                    "ph": "X",
                    "pid": self.rank,
                    "tid": ROWS.index(s.lane),
                    "ts": (s.start - self.origin) * 1e6,
                    "dur": (s.end - s.start) * 1e6,
                    "args": {"step": s.step, "unit": s.unit, "chunk": s.chunk}
                    | ({"bytes": s.nbytes} if s.nbytes else {}),
                }
            )
        # ts counts from origin_s, this process's time.perf_counter() at the tracer's start (the host's monotonic
        # clock: the ranks of one host share it, so their traces can be laid on one time line)
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"origin_s": self.origin}}

    def close(self) -> None:
        """Write the remaining steps, the Gantt figure (TensorBoard and ``gantt_rank{r}.png``) and the Chrome
        trace; an engine that ran no training step writes nothing (a validate-only run must not overwrite the
        trace of the fit before it)."""
        if not self.enabled or not self._bounds:
            self.enabled = False
            return
        for step in sorted(s for s in self._bounds if s not in self._written):
            self._write_step(step)
        assert self.dir is not None  # enabled implies a directory
        self.dir.mkdir(parents=True, exist_ok=True)
        if self._gantt is not None:
            spans, start, end, next_start = self._gantt
            fig = self.gantt(spans, start, end, self.gantt_step, next_start)
            fig.savefig(self.dir / f"gantt_rank{self.rank}.png", dpi=100)
            self._tb().add_figure("lanes/gantt", fig, self.gantt_step)  # closes the figure
        path = self.dir / f"trace_rank{self.rank}.json"
        path.write_text(json.dumps(self.chrome_trace()))
        if self._writer is not None:
            self._writer.close()
        log.info(
            "SlideDP trace of rank %d: %d spans -> %s, Gantt and TensorBoard under %s",
            self.rank,
            len(self.spans),
            path,
            self.dir,
        )
        self.enabled = False


class _SpanContext:
    __slots__ = ("tracer", "lane", "name", "step", "unit", "chunk", "start")

    def __init__(self, tracer: Tracer, lane: str, name: str, step: int, unit: int, chunk: int) -> None:
        self.tracer, self.lane, self.name, self.step, self.unit, self.chunk = tracer, lane, name, step, unit, chunk

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.tracer.record(self.lane, self.name, self.step, self.start, time.perf_counter(), self.unit, self.chunk)
