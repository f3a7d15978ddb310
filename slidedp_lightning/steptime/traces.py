"""Measured steps from the runtime's lane traces (TensorBoard scalars written per step under ``trace_dir``)."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from slidedp_lightning.intervals import merge_intervals
from slidedp_lightning.steptime.graph import LANES
from slidedp_lightning.steptime.simulate import classify


def read_steps(trace_dir: str | Path, rank: int = 0) -> dict[int, dict[str, float]]:
    """step -> metrics (seconds) of one rank, as ``runtime.trace.step_metrics`` wrote them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = Path(trace_dir) / f"rank{rank}"
    if not path.is_dir():
        raise FileNotFoundError(f"no lane trace of rank {rank} under {trace_dir}")
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    steps: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        key = tag.split("/", 1)[1]
        if key.endswith("_ms"):
            key, scale = key[:-3], 1e-3
        else:
            scale = 1.0
        key = f"busy_{key}" if tag.startswith("lanes/") else key
        for ev in acc.Scalars(tag):
            steps.setdefault(ev.step, {})[key] = ev.value * scale
    return steps


def traced_ranks(trace_dir: str | Path) -> list[int]:
    """The ranks whose lane traces (``rank<N>`` folders) are under ``trace_dir``."""
    return sorted(int(p.name[4:]) for p in Path(trace_dir).glob("rank*") if p.is_dir() and p.name[4:].isdigit())


def _chrome(trace_dir: Path, rank: int) -> tuple[dict[int, float], dict[int, float]]:
    """From one rank's Chrome trace: step -> start of its first forward span (seconds), and step -> seconds the
    compute thread spent in traced work (its compute spans, its stalls and the issue of each unit's gradient, which
    the reduce lane records and the compute thread runs), as a union."""
    path = trace_dir / f"trace_rank{rank}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no Chrome trace of rank {rank} under {trace_dir}")
    first: dict[int, float] = {}
    spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for ev in json.loads(path.read_text())["traceEvents"]:
        if ev.get("ph") != "X":
            continue
        k = ev["args"]["step"]
        if ev["cat"] == "compute" and ev["name"] == "forward":
            first[k] = min(first.get(k, math.inf), ev["ts"] * 1e-6)
        if ev["cat"] in ("compute", "stall") or (ev["cat"] == "reduce" and ev["name"] == "issue"):
            spans[k].append((ev["ts"], ev["ts"] + ev["dur"]))
    return first, {k: sum(b - a for a, b in merge_intervals(iv)) * 1e-6 for k, iv in spans.items()}


def iterations(first: dict[int, float]) -> dict[int, float]:
    """step k -> seconds from its first forward to step k+1's: one whole training iteration, the loop between
    optimizer steps included (the runtime's step window ends at the step's close)."""
    return {k: first[k + 1] - first[k] for k in first if k + 1 in first}


def measured(trace_dir: str | Path, skip: int = 2, ranks: int = 2) -> dict:
    """Median iteration time (slowest rank per step) with its quartiles, the median step window (first forward to
    the step's close), median lane busy times, exposed time (iteration less compute) and stall (rank 0), and the
    bottleneck label."""
    trace_dir = Path(trace_dir)
    per_rank = [read_steps(trace_dir, r) for r in range(ranks)]
    its = [iterations(_chrome(trace_dir, r)[0]) for r in range(ranks)]
    steps = sorted(set.intersection(*(set(s) for s in per_rank), *(set(i) for i in its)))[skip:]
    if not steps:
        raise ValueError(f"{trace_dir}: no traced steps after skipping {skip}")
    times = [max(i[k] for i in its) for k in steps]
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    busy = {lane: statistics.median(per_rank[0][k].get(f"busy_{lane}", 0.0) for k in steps) for lane in LANES}
    exposed = statistics.median(its[0][k] - per_rank[0][k].get("busy_compute", 0.0) for k in steps)
    stall = statistics.median(per_rank[0][k].get("busy_stall", 0.0) for k in steps)
    window = statistics.median(max(s[k]["step_time"] for s in per_rank) for k in steps)
    return {
        "step_time": statistics.median(times),
        "p25": q[0],
        "p75": q[2],
        "window": window,
        "busy": busy,
        "exposed_host": exposed,
        "stall": stall,
        "bottleneck": classify(busy),
        "steps": len(steps),
    }


def loop_time(trace_dir: str | Path, skip: int = 2) -> float:
    """Median over every rank and step (after ``skip``) of the compute thread's time per iteration outside the
    runtime's traced work: the training loop's Python between and inside steps, the training step, the loss and
    its logging."""
    trace_dir = Path(trace_dir)
    ranks = traced_ranks(trace_dir)
    if not ranks:
        raise FileNotFoundError(f"no lane traces under {trace_dir}")
    samples = []
    for r in ranks:
        first, traced = _chrome(trace_dir, r)
        its = iterations(first)
        for k in sorted(its)[skip:]:
            if k in traced:
                samples.append(max(0.0, its[k] - traced[k]))
    if not samples:
        raise ValueError(f"{trace_dir}: no traced steps after skipping {skip}")
    return statistics.median(samples)


def other_threads_cpu(trace_dir: str | Path, skip: int = 2) -> float | None:
    """Median over every rank and step (after ``skip``) of the CPU seconds the process used outside its compute
    thread in one iteration (the runtime records both CPU times per step); None for traces without them."""
    trace_dir = Path(trace_dir)
    ranks = traced_ranks(trace_dir)
    samples = []
    for r in ranks:
        steps = read_steps(trace_dir, r)
        samples += [
            steps[k]["cpu_process"] - steps[k]["cpu_compute_thread"]
            for k in sorted(steps)[skip:]
            if "cpu_process" in steps[k] and "cpu_compute_thread" in steps[k]
        ]
    return statistics.median(samples) if samples else None


def disk_rate(trace_dir: str | Path, skip: int = 2) -> tuple[float, dict[str, float]]:
    """The rate the state file's disk gave a traced run (state on disk): per step after ``skip``, the bytes every
    rank of the host read and wrote over the time any of them had a read or write under way (their disk spans on
    one time line), the median over steps in bytes per second; with the medians of those bytes and seconds."""
    trace_dir = Path(trace_dir)
    ranks = traced_ranks(trace_dir)
    if not ranks:
        raise FileNotFoundError(f"no lane traces under {trace_dir}")
    nbytes: dict[int, int] = defaultdict(int)
    spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for r in ranks:
        trace = json.loads((trace_dir / f"trace_rank{r}.json").read_text())
        origin = trace.get("otherData", {}).get("origin_s")
        disk = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["cat"] == "disk"]
        if origin is None or any("bytes" not in e["args"] for e in disk):
            raise ValueError(
                f"{trace_dir}: rank {r}'s trace has no clock origin or no bytes on its disk spans (written by an "
                "older version): trace the run again"
            )
        for e in disk:
            k = e["args"]["step"]
            nbytes[k] += e["args"]["bytes"]
            spans[k].append((origin + e["ts"] * 1e-6, origin + (e["ts"] + e["dur"]) * 1e-6))
    steps = sorted(spans)[skip:]
    if not steps:
        raise ValueError(f"{trace_dir}: no disk spans after skipping {skip} steps (was the state on disk?)")
    busy = {k: sum(b - a for a, b in merge_intervals(spans[k])) for k in steps}
    rate = statistics.median(nbytes[k] / busy[k] for k in steps if busy[k] > 0)
    return rate, {
        "bytes": statistics.median(nbytes[k] for k in steps),
        "busy_s": statistics.median(busy.values()),
        "steps": len(steps),
    }
