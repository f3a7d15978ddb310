"""Measured steps from the runtime's lane traces (TensorBoard scalars written per step under ``trace_dir``)."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from slidedp_lightning.runtime.trace import merge_intervals
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


def measured(trace_dir: str | Path, skip: int = 2, ranks: int = 2) -> dict:
    """Median step time (slowest rank per step) with its quartiles, median lane busy times, exposed host time and
    stall (rank 0), and the bottleneck label."""
    per_rank = [read_steps(trace_dir, r) for r in range(ranks)]
    steps = sorted(set.intersection(*(set(s) for s in per_rank)))[skip:]
    if not steps:
        raise ValueError(f"{trace_dir}: no traced steps after skipping {skip}")
    times = [max(s[k]["step_time"] for s in per_rank) for k in steps]
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    busy = {lane: statistics.median(per_rank[0][k].get(f"busy_{lane}", 0.0) for k in steps) for lane in LANES}
    exposed = statistics.median(per_rank[0][k].get("exposed_host", 0.0) for k in steps)
    stall = statistics.median(per_rank[0][k].get("busy_stall", 0.0) for k in steps)
    return {"step_time": statistics.median(times), "p25": q[0], "p75": q[2], "busy": busy, "exposed_host": exposed,
            "stall": stall, "bottleneck": classify(busy), "steps": len(steps)}


def _compute_thread(trace_dir: Path, rank: int) -> dict[int, float]:
    """step -> seconds the compute thread spent in traced work: its compute spans, its stalls and the issue of each
    unit's gradient (recorded on the reduce lane, run on the compute thread), as a union."""
    path = trace_dir / f"trace_rank{rank}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no Chrome trace of rank {rank} under {trace_dir}")
    spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for ev in json.loads(path.read_text())["traceEvents"]:
        if ev.get("ph") == "X" and (ev["cat"] in ("compute", "stall") or (ev["cat"] == "reduce" and ev["name"] == "issue")):
            spans[ev["args"]["step"]].append((ev["ts"], ev["ts"] + ev["dur"]))
    return {k: sum(b - a for a, b in merge_intervals(iv)) * 1e-6 for k, iv in spans.items()}


def loop_time(trace_dir: str | Path, skip: int = 2) -> float:
    """Median over every rank and step (after ``skip``) of the compute thread's step time outside the runtime's
    traced work: the training loop's Python, the training step, the loss and its logging."""
    trace_dir = Path(trace_dir)
    ranks = sorted(int(p.name[4:]) for p in trace_dir.glob("rank*") if p.is_dir() and p.name[4:].isdigit())
    if not ranks:
        raise FileNotFoundError(f"no lane traces under {trace_dir}")
    samples = []
    for r in ranks:
        steps, traced = read_steps(trace_dir, r), _compute_thread(trace_dir, r)
        for k in sorted(steps)[skip:]:
            if k in traced:
                samples.append(max(0.0, steps[k]["step_time"] - traced[k]))
    if not samples:
        raise ValueError(f"{trace_dir}: no traced steps after skipping {skip}")
    return statistics.median(samples)
