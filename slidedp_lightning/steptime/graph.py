"""One rank's operation graph of a training step: per-unit ops, their lanes, resource demands and dependencies.

Ranks are symmetric, so one rank is modelled and shared resources get a 1/R share (``Profile.capacities``).
Resources: ``gpu`` (FLOPs), ``h2d``/``d2h`` (PCIe bytes), ``link`` (GPU interconnect bytes), ``cpu`` (update
bytes), ``dram`` (host memory bytes), and ``cores`` (core-seconds) where the host is the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cpu_ops.bandwidth import update_bytes_per_param
from slidedp_lightning.steptime.profiles import Profile
from slidedp_lightning.steptime.workload import ModelShape, UnitActivation, units

PARAM_ROUTES = ("full", "sharded", "replicated")
GRAD_ROUTES = ("gpu_reduce", "host_reduce")
PRECISIONS = ("bf16-mixed", "32-true")
LANES = ("h2d", "offload", "compute", "reduce", "d2h", "update")


@dataclass
class StepConfig:
    """What is trained and how: per-GPU batch, sequence length, R ranks, routes, chunks, window, activations."""

    model: ModelShape
    batch: int
    seq: int
    gpus: int
    param_route: str = "full"
    grad_route: str = "gpu_reduce"
    chunk_bytes: int | None = None
    prefetch_window: int = 2
    activation: str | UnitActivation | list[UnitActivation] = "none"
    precision: str = "bf16-mixed"

    def __post_init__(self) -> None:
        if self.param_route not in PARAM_ROUTES:
            raise ValueError(f"unknown param_route {self.param_route!r}; choose one of {PARAM_ROUTES}")
        if self.grad_route not in GRAD_ROUTES:
            raise ValueError(f"unknown grad_route {self.grad_route!r}; choose one of {GRAD_ROUTES}")
        if self.param_route == "replicated" and self.grad_route != "gpu_reduce":
            raise ValueError("param_route 'replicated' all-reduces gradients on the devices: use grad_route 'gpu_reduce'")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; choose one of {PRECISIONS}")
        for name in ("batch", "seq", "gpus", "prefetch_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.chunk_bytes is not None and (not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 1):
            raise ValueError(f"chunk_bytes must be None or an integer >= 1, got {self.chunk_bytes!r}")

    @property
    def tokens(self) -> int:
        """Tokens per rank per step."""
        return self.batch * self.seq


@dataclass
class Op:
    name: str
    lane: str
    step: int
    unit: int
    demand: dict[str, float]
    fixed: float = 0.0  # seconds of latency before the op's work (no resource held)
    deps: list[int] = field(default_factory=list)
    chunk: int = -1


class _Builder:
    def __init__(self) -> None:
        self.ops: list[Op] = []

    def add(self, op: Op) -> int:
        self.ops.append(op)
        return len(self.ops) - 1


def _collective(kind: str, nbytes: float, steps: int, latency: float) -> tuple[dict[str, float], float]:
    """Per-rank demand of a ring collective moving ``nbytes`` per rank in each direction."""
    if kind in ("nvlink", "loopback"):  # a link of its own (loopback: gloo between CPU ranks)
        return {"link": nbytes}, steps * latency
    if kind == "pcie":  # peer-to-peer over the GPUs' own PCIe links, at most at the collective's own rate
        return {"h2d": nbytes, "d2h": nbytes, "link": nbytes}, steps * latency
    if kind == "host":  # no P2P: staged through host memory (down, then up)
        return {"d2h": nbytes, "h2d": nbytes, "dram": 2 * nbytes, "link": nbytes}, steps * latency
    return {}, 0.0


def build_ops(cfg: StepConfig, profile: Profile, steps: int = 2) -> list[Op]:
    """The ops of ``steps`` consecutive steps of one rank, in lane order (list order = order within a lane)."""
    profile.check_gpus(cfg.gpus)
    r = cfg.gpus
    us = units(cfg.model, cfg.seq, cfg.activation, act_bytes=2 if cfg.precision == "bf16-mixed" else 4)
    n_units = len(us)
    pb = 2 if cfg.precision == "bf16-mixed" else 4
    kind = profile.link_kind if r > 1 else "none"
    lat = profile.link_latency_s
    tok = cfg.tokens
    b = _Builder()
    last_update: dict[int, list[int]] = {}  # unit -> update ops of the previous step
    compute_seq: list[int] = []  # every compute op in order, across steps (the prefetch window counts these)

    def fetch(u: int, step: int, backward: bool) -> list[int]:
        """H2D (and all-gather) of unit u, issued when the compute op W places back has finished."""
        p = us[u].params
        deps = [compute_seq[-cfg.prefetch_window]] if len(compute_seq) >= cfg.prefetch_window else []
        if not backward:
            deps += last_update.get(u, [])
        tag = "bwd" if backward else "fwd"
        sharded = cfg.param_route == "sharded" and r > 1
        nbytes = p * pb / r if sharded else p * pb
        ids = [b.add(Op(f"h2d {tag}", "h2d", step, u, {"h2d": nbytes, "dram": nbytes}, profile.copy_latency_s, deps))]
        if sharded:
            demand, fixed = _collective(kind, p * pb * (r - 1) / r, r - 1, lat)
            ids.append(b.add(Op(f"all_gather {tag}", "h2d", step, u, demand, fixed, [ids[-1]])))
        return ids

    def compute(name: str, u: int, step: int, flops: float, deps: list[int]) -> int:
        deps = deps + ([compute_seq[-1]] if compute_seq else [])
        i = b.add(Op(name, "compute", step, u, {"gpu": flops}, profile.op_overhead_s if flops else 0.0, deps))
        compute_seq.append(i)
        return i

    for step in range(steps):
        offloaded: dict[int, int] = {}
        for u, unit in enumerate(us):  # forward
            ready = [i for v in (u, *unit.borrows) for i in fetch(v, step, backward=False)[-1:]]
            f = compute("forward", u, step, tok * unit.fwd_flops_per_token, ready)
            act = unit.activation
            if act.offload_ratio > 0:
                nbytes = act.retained_bytes_per_token * tok * act.offload_ratio
                offloaded[u] = b.add(Op("offload", "offload", step, u, {"d2h": nbytes, "dram": nbytes}, 0.0, [f]))
        compute("loss", n_units - 1, step, 0.0, [])
        b.ops[compute_seq[-1]].fixed = profile.step_overhead_s
        updates: dict[int, list[int]] = {}
        for u in reversed(range(n_units)):  # backward
            unit = us[u]
            ready = [i for v in (u, *unit.borrows) for i in fetch(v, step, backward=True)[-1:]]
            if u in offloaded:
                nbytes = b.ops[offloaded[u]].demand["d2h"]
                window = [compute_seq[-cfg.prefetch_window]] if len(compute_seq) >= cfg.prefetch_window else []
                ready.append(b.add(Op("reload", "offload", step, u, {"h2d": nbytes, "dram": nbytes}, 0.0,
                                      window + [offloaded[u]])))  # fmt: skip
            fwd = tok * unit.fwd_flops_per_token
            if unit.activation.recompute_fraction > 0:
                ready = [compute("recompute", u, step, fwd * unit.activation.recompute_fraction, ready)]
            done = compute("backward", u, step, fwd * profile.bwd_fwd_ratio, ready)
            updates[u] = _gradient(b, cfg, profile, kind, unit.params, pb, u, step, done)
        last_update = updates
    return b.ops


def _gradient(b: _Builder, cfg: StepConfig, profile: Profile, kind: str, p: int, pb: int, u: int, step: int,
              done: int) -> list[int]:  # fmt: skip
    """Reduce, D2H and update ops of one unit's gradient; returns the update ops."""
    r, lat = cfg.gpus, profile.link_latency_s
    if cfg.grad_route == "host_reduce":
        d2h = b.add(Op("d2h", "d2h", step, u, {"d2h": p * pb, "dram": p * pb}, profile.copy_latency_s, [done]))
        nbytes = p / r * update_bytes_per_param(pb, rows=r, bf16_out=cfg.precision == "bf16-mixed")
        return [b.add(Op("update", "update", step, u, {"cpu": nbytes, "dram": nbytes}, 0.0, [d2h]))]
    replicated = cfg.param_route == "replicated"
    share = p if replicated else p / r  # parameters this rank receives and updates
    n_chunks = max(1, math.ceil(share * 4 / cfg.chunk_bytes)) if cfg.chunk_bytes else 1
    per_upd = update_bytes_per_param(4, rows=1, bf16_out=cfg.precision == "bf16-mixed")
    out = []
    for k in range(n_chunks):
        frac = 1 / n_chunks
        if r > 1:
            moved = (2 if replicated else 1) * p * 4 * (r - 1) / r * frac
            demand, fixed = _collective(kind, moved, (2 if replicated else 1) * (r - 1), lat)
            red = b.add(Op("all_reduce" if replicated else "reduce_scatter", "reduce", step, u, demand, fixed, [done], k))
        else:
            red = done
        nbytes = share * 4 * frac
        d2h = b.add(Op("d2h", "d2h", step, u, {"d2h": nbytes, "dram": nbytes}, profile.copy_latency_s, [red], k))
        upd = share * frac * per_upd
        out.append(b.add(Op("update", "update", step, u, {"cpu": upd, "dram": upd}, 0.0, [d2h], k)))
    return out
