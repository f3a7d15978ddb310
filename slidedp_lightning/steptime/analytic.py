"""Closed-form model (arXiv 2609.34162, §3.5): T_step ~ max(per-resource and per-lane service) + dependency exposure.

Per resource r, work_r / capacity_r is the least time r needs (``bounds``); per lane, the sum of its ops'
stand-alone times (``lanes``). The exposure is the chain that can never overlap compute: after the last
backward (unit 0) its gradient is reduced, returned, applied and fetched again before the next forward
(chunked: a pipeline over the chunks).
"""

from __future__ import annotations

from dataclasses import dataclass

from slidedp_lightning.steptime.graph import LANES, StepConfig
from slidedp_lightning.steptime.ops import build_ops
from slidedp_lightning.steptime.profiles import Profile
from slidedp_lightning.steptime.simulate import classify, standalone


@dataclass
class Analytic:
    bounds: dict[str, float]  # resource -> work / capacity (seconds)
    lanes: dict[str, float]  # lane -> sum of stand-alone op times (seconds)
    exposure: float
    step_time: float
    tokens_per_s: float
    bottleneck: str


def pipeline(stages: list[list[float]]) -> float:
    """Makespan of chunks flowing through stages in order (``stages[k][j]``: chunk k in stage j), one at a time per stage."""
    free = [0.0] * (len(stages[0]) if stages else 0)
    for chunk in stages:
        t = 0.0
        for j, d in enumerate(chunk):
            t = max(t, free[j]) + d
            free[j] = t
    return max(free, default=0.0)


def analyze(cfg: StepConfig, profile: Profile) -> Analytic:
    """Lower bounds, lane service times, exposure and the step-time estimate of one steady-state step."""
    cap = profile.capacities(cfg.gpus, cfg.hosts)
    ops = [op for op in build_ops(cfg, profile, steps=2) if op.step == 1]
    bounds = {res: 0.0 for res in cap}
    lanes = {lane: 0.0 for lane in LANES}
    for op in ops:
        t = standalone(op, cap)
        lanes[op.lane] += t + op.fixed
        for res, v in op.demand.items():
            if res in cap:
                bounds[res] += v / cap[res]
        if "cores" in cap and op.lane != "disk":
            bounds["cores"] += t / cap["cores"]
    tail = [op for op in ops if op.unit == 0 and op.lane in ("reduce", "net", "d2h", "update")]
    chunks = sorted({op.chunk for op in tail})
    stages = [[standalone(op, cap) + op.fixed for op in tail if op.chunk == k] for k in chunks]
    i = next(k for k, op in enumerate(ops) if op.lane == "h2d")
    first_fetch = ops[i]
    # host-sharded: the first fetch also waits for its gather between hosts (the op after it on the h2d lane)
    gather = [op for op in ops[i + 1 : i + 2] if op.name == "all_gather_net fwd"]
    exposure = pipeline(stages) + sum(standalone(op, cap) + op.fixed for op in [first_fetch, *gather])
    service = max(max(bounds.values()), max(lanes.values()))
    step = service + exposure
    return Analytic(bounds, lanes, exposure, step, cfg.tokens * cfg.gpus * cfg.hosts / step, classify(lanes))
