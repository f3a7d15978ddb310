"""Discrete-event simulation of the six lanes over one rank's operation graph.

Each lane runs its ops one at a time in order; an op starts when its lane is free and its dependencies are
done. Running ops share resources fluidly: rates are water-filled so that every op runs at the same fraction
of its stand-alone speed until a resource saturates (concurrent H2D shares the PCIe root, the update competes
with copies for DRAM, and on a CPU machine every lane competes for the cores).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from slidedp_lightning.intervals import merge_intervals
from slidedp_lightning.steptime.graph import LANES, Op, StepConfig
from slidedp_lightning.steptime.ops import build_ops
from slidedp_lightning.steptime.profiles import Profile

EPS = 1e-12


@dataclass
class Span:
    lane: str
    name: str
    step: int
    unit: int
    start: float
    end: float


@dataclass
class SimResult:
    """One steady-state step (the second simulated step) of one rank. ``busy`` and ``exposed`` per lane, and for
    "loop": the compute thread's work outside the units (the loss, the training loop), not a lane of its own."""

    step_time: float
    tokens_per_s: float
    busy: dict[str, float]
    exposed: dict[str, float]
    bottleneck: str
    spans: list[Span] = field(default_factory=list)


def standalone(op: Op, cap: dict[str, float]) -> float:
    """Seconds of work (after ``op.fixed``) with every resource to itself."""
    return max((v / cap[k] for k, v in op.demand.items() if v and cap.get(k, math.inf) < math.inf), default=0.0)


def _rates(active: list[int], usage: dict[int, dict[str, float]], cap: dict[str, float]) -> dict[int, float]:
    """Water-filling: fraction of stand-alone speed for each active op (max-min fair across resources)."""
    theta: dict[int, float] = {}
    left = dict(cap)
    free = set(active)
    while free:
        level, tight = 1.0, None
        for res, c in left.items():
            load = sum(usage[i].get(res, 0.0) for i in free)
            if load > EPS and c / load < level:
                level, tight = c / load, res
        if tight is None:
            theta.update({i: level for i in free})
            break
        frozen = {i for i in free if usage[i].get(tight, 0.0) > EPS}
        for i in frozen:
            theta[i] = level
            for res, u in usage[i].items():
                left[res] = max(0.0, left[res] - level * u)
        free -= frozen
    return theta


def run(ops: list[Op], cap: dict[str, float]) -> list[tuple[float, float]]:
    """Start and end time of every op."""
    cap = {k: v for k, v in cap.items() if v < math.inf}
    host_cores = "cores" in cap
    dur = [standalone(op, cap) for op in ops]
    usage = {}
    for i, op in enumerate(ops):
        use = {k: v / dur[i] for k, v in op.demand.items() if k in cap and v and dur[i] > 0}
        if host_cores and dur[i] > 0 and op.lane != "disk":  # the disk's I/O threads wait, they do not compute
            use["cores"] = 1.0  # one core-second per second of stand-alone work
        usage[i] = use
    queues: dict[str, list[int]] = {}
    for i, op in enumerate(ops):
        queues.setdefault(op.lane, []).append(i)
    head = {lane: 0 for lane in queues}
    busy_lane: dict[str, int | None] = {lane: None for lane in queues}
    done = [False] * len(ops)
    times = [(math.nan, math.nan)] * len(ops)
    fixed_left = [op.fixed for op in ops]
    work_left = [1.0 if d > 0 else 0.0 for d in dur]
    t = 0.0
    n_done = 0
    while n_done < len(ops):
        for lane, q in queues.items():
            while busy_lane[lane] is None and head[lane] < len(q):
                i = q[head[lane]]
                if not all(done[d] for d in ops[i].deps):
                    break
                busy_lane[lane] = i
                times[i] = (t, math.nan)
                head[lane] += 1
                if fixed_left[i] <= 0 and work_left[i] <= 0:
                    done[i], busy_lane[lane], n_done = True, None, n_done + 1
                    times[i] = (t, t)
        active = [i for i in busy_lane.values() if i is not None]
        if not active:
            raise RuntimeError("step graph deadlocked (a dependency is never satisfied)")
        fluid = [i for i in active if fixed_left[i] <= 0]
        theta = _rates(fluid, usage, cap) if fluid else {}
        dt = math.inf
        for i in active:
            if fixed_left[i] > 0:
                dt = min(dt, fixed_left[i])
            elif theta.get(i, 0) > 0:
                dt = min(dt, work_left[i] * dur[i] / theta[i])
        t += dt
        for i in active:
            if fixed_left[i] > 0:
                fixed_left[i] -= dt
                if fixed_left[i] <= EPS:
                    fixed_left[i] = 0.0
            else:
                work_left[i] -= dt * theta[i] / dur[i]
            if fixed_left[i] <= 0 and work_left[i] <= 1e-9:
                done[i] = True
                n_done += 1
                busy_lane[ops[i].lane] = None
                times[i] = (times[i][0], t)
    return times


def classify(busy: dict[str, float]) -> str:
    """``gpu-bound`` if compute is the busiest lane, else ``host-bound (<busiest lane>)`` (arXiv 2609.34162, §3.5)."""
    lane = max((k for k in busy if k != "compute"), key=lambda k: busy[k], default=None)
    if lane is None or busy.get("compute", 0.0) >= busy[lane]:
        return "gpu-bound"
    return f"host-bound ({lane})"


STEADY = 2  # the step reported: after two steps, any backlog a lane starts with is worked off


def simulate(cfg: StepConfig, profile: Profile) -> SimResult:
    """Simulate ``STEADY + 1`` steps and report the last (steady state: its fetches wait on the step before's
    updates, and a lane slower than the compute, such as a disk, carries no backlog from the graph's start)."""
    ops = build_ops(cfg, profile, steps=STEADY + 1)
    times = run(ops, profile.capacities(cfg.gpus, cfg.hosts))
    spans = [Span(op.shown or op.lane, op.name, op.step, op.unit, a, b) for op, (a, b) in zip(ops, times)]
    ends = [max(s.end for s in spans if s.lane == "compute" and s.step == k) for k in (STEADY - 1, STEADY)]
    lo, hi = ends
    step_time = hi - lo
    this = [s for s in spans if s.step == STEADY]
    busy = {
        lane: sum(b - a for a, b in merge_intervals([(s.start, s.end) for s in this if s.lane == lane]))
        for lane in LANES
    }
    edges = []
    for s in spans:
        if s.end > lo and s.start < hi and s.end > s.start:
            edges += [(max(s.start, lo), 1, s.lane), (min(s.end, hi), -1, s.lane)]
    edges.sort(key=lambda e: (e[0], e[1]))
    # compute-idle time in the step window, shared among the lanes busy meanwhile ("loop": the compute thread's work
    # outside the units, which the runtime does not trace as compute)
    exposed = {lane: 0.0 for lane in (*LANES, "loop")}
    count = {lane: 0 for lane in exposed}
    prev = lo
    for x, delta, lane in edges:
        if x > prev and count["compute"] == 0:
            live = [k for k, c in count.items() if c > 0]
            for k in live:
                exposed[k] += (x - prev) / len(live)
        prev = max(prev, x)
        count[lane] += delta
    tokens = cfg.tokens * cfg.gpus * cfg.hosts  # every rank of every host
    label = classify(busy)
    busy["loop"] = sum(b - a for a, b in merge_intervals([(s.start, s.end) for s in this if s.lane == "loop"]))
    return SimResult(step_time, tokens / step_time if step_time > 0 else math.inf, busy, exposed, label, spans)
