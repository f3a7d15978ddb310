"""One rank's operation graph of a training step: per-unit ops, their lanes, resource demands and dependencies.

Ranks are symmetric, so one rank is modelled and shared resources get a 1/R share (``Profile.capacities``).
Resources: ``gpu`` (FLOPs), ``h2d``/``d2h`` (PCIe bytes), ``link`` (GPU interconnect bytes), ``cpu`` (update
bytes), ``dram`` (host memory bytes), ``net`` (inter-host network bytes, with several hosts) and ``cores``
(core-seconds) where the host is the device.

Several hosts (``hosts`` = N, R ranks each), two layouts of the host state, as the runtime runs them:
- ``replicated``: every host holds the whole ledger; a unit's gradient is reduce-scattered within the host, then
  each rank's reduced 1/R shard is all-reduced between the N ranks of the same local index (``net`` lane; the
  runtime issues it from a lane thread once the host's reduction is done, so the compute thread never waits for
  either), and every host updates its shard in its own ledger (per-host update work and ledger as on one host);
- ``sharded``: each host owns 1/N of every unit, each rank 1/(N R): the gradient is reduce-scattered over all N R
  ranks in one flat ring and the parameters come back by a fetch of the rank's 1/(N R) shard and one flat
  all-gather over all N R ranks (:func:`flat_collective`); each host updates only its 1/N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from slidedp_lightning.constants import (
    GRAD_ROUTES,
    HOST_LAYOUTS,
    IN_LEDGER_MIN_BYTES,
    LEDGER_BYTES_PER_PARAM,
    MASTER_BYTES,
    OPTIMIZER_STATES,
    UNIT_COPIES,
    h2d_bytes_per_param,
    ledger_bytes_per_param,
    moment_bytes,
    update_bytes_per_param,
)
from slidedp_lightning.constants import PARAM_ROUTES as LIBRARY_PARAM_ROUTES
from slidedp_lightning.steptime.profiles import Profile
from slidedp_lightning.steptime.workload import ModelShape, UnitActivation, units

# "slideformer" is not a route of this runtime: it models the paper's replicated baseline (SlideFormer's multi-GPU
# form, as its public code runs it), see :mod:`slidedp_lightning.steptime.slideformer`.
PARAM_ROUTES: tuple[str, ...] = (*LIBRARY_PARAM_ROUTES, "slideformer")
# the precisions the model has rates for: a subset of ``constants.PRECISIONS`` (no 16-mixed)
PRECISIONS: tuple[str, ...] = ("bf16-mixed", "32-true")
LANES = ("h2d", "offload", "compute", "reduce", "net", "d2h", "update", "disk")


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
    hosts: int = 1
    host_layout: str = "replicated"
    # the runtime's backpressure (``EngineConfig.max_units_in_flight``, 2 there): before it reduces a unit's
    # gradient, the compute thread waits until fewer than this many units wait for (or are in) the CPU update;
    # None: not modelled (the paper checks are stated without it)
    max_units_in_flight: int | None = None
    # the training step all-reduces its loss over every rank (Lightning's ``self.log(..., sync_dist=True)``) between
    # forward and backward, on the compute thread
    loss_sync: bool = False
    # the ledger's mode (EngineConfig): int8 moments; no BF16 copy (units converted from the master on the way,
    # on the host into staging or, h2d_convert "device", after an FP32 copy)
    optimizer_state: str = "fp32"
    bf16_copy: bool = True
    h2d_convert: str = "host"
    # the moments in a state file on a local disk (StateOnDisk): every update reads and writes them there too,
    # through the profile's ``disk`` resource (``disk_gbps``: reads and writes at once, ``bench.disk_ceiling``)
    state_on_disk: bool = False
    # with state_on_disk: the FP32 master there too (StateOnDisk(master=True)): read and written with the moments
    master_on_disk: bool = False
    # which units a CPU "device" computes on in the ledger instead of a copy (EngineConfig.unit_copies): "auto"
    # those of at least IN_LEDGER_MIN_BYTES, "never" (copies) every one the dtype allows, "always" none
    unit_copies: str = "auto"

    def __post_init__(self) -> None:
        if self.master_on_disk and not (self.state_on_disk and self.bf16_copy):
            raise ValueError("master_on_disk is part of the state on disk (state_on_disk) and needs the BF16 copy")
        if self.optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(f"unknown optimizer_state {self.optimizer_state!r}; choose one of {OPTIMIZER_STATES}")
        if self.param_route not in PARAM_ROUTES:
            raise ValueError(f"unknown param_route {self.param_route!r}; choose one of {PARAM_ROUTES}")
        if self.grad_route not in GRAD_ROUTES:
            raise ValueError(f"unknown grad_route {self.grad_route!r}; choose one of {GRAD_ROUTES}")
        if self.param_route == "replicated" and self.grad_route != "gpu_reduce":
            raise ValueError(
                "param_route 'replicated' all-reduces gradients on the devices: use grad_route 'gpu_reduce'"
            )
        if self.param_route == "slideformer" and (self.grad_route, self.precision) != ("host_reduce", "bf16-mixed"):
            raise ValueError(
                "param_route 'slideformer' (the paper's replicated baseline) sums BF16 gradients on the "
                "host: use grad_route 'host_reduce' and precision 'bf16-mixed'"
            )
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; choose one of {PRECISIONS}")
        if self.unit_copies not in UNIT_COPIES:
            raise ValueError(f"unknown unit_copies {self.unit_copies!r}; choose one of {UNIT_COPIES}")
        for name in ("batch", "seq", "gpus", "prefetch_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.hosts, int) or isinstance(self.hosts, bool) or self.hosts < 1:
            raise ValueError(f"hosts must be an integer >= 1, got {self.hosts!r}")
        if self.host_layout not in HOST_LAYOUTS:
            raise ValueError(f"unknown host_layout {self.host_layout!r}; choose one of {HOST_LAYOUTS}")
        if self.hosts > 1:
            if self.param_route not in ("full", "sharded"):
                raise ValueError(
                    f"hosts > 1: param_route {self.param_route!r} is a single-host route; use 'full' or 'sharded'"
                )
            if self.grad_route != "gpu_reduce":
                raise ValueError(
                    "hosts > 1: gradients are reduced on the devices, then between hosts: use grad_route 'gpu_reduce'"
                )
            if self.host_layout == "sharded" and self.param_route != "sharded":
                raise ValueError(
                    "host_layout 'sharded' gathers every unit from its 1/(hosts x gpus) shards: use "
                    "param_route 'sharded'"
                )
        m = self.max_units_in_flight
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(f"max_units_in_flight must be None or an integer >= 1, got {m!r}")
        if self.chunk_bytes is not None and (not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 1):
            raise ValueError(f"chunk_bytes must be None or an integer >= 1, got {self.chunk_bytes!r}")

    @property
    def tokens(self) -> int:
        """Tokens per rank per step."""
        return self.batch * self.seq

    @property
    def host_sharded(self) -> bool:
        """Each host owns 1/N of the state (N > 1, layout ``sharded``)."""
        return self.hosts > 1 and self.host_layout == "sharded"

    @property
    def state_share(self) -> float:
        """Share of every unit's ledger (and of its update) one host holds: 1/N host-sharded, else 1."""
        return 1 / self.hosts if self.host_sharded else 1.0


def host_ledger_bytes(cfg: StepConfig) -> float:
    """Host memory of the ledger on each host (bytes): 14 B/param (8.008 int8, 6.008 int8 without the BF16 copy),
    divided by N when host-sharded."""
    default = cfg.optimizer_state == "fp32" and cfg.bf16_copy
    per = LEDGER_BYTES_PER_PARAM if default else ledger_bytes_per_param(cfg.optimizer_state, cfg.bf16_copy)
    per -= disk_bytes_per_param(cfg) / 2  # the moments (and the master) kept on disk
    return per * cfg.model.total_params * cfg.state_share


def disk_bytes_per_param(cfg: StepConfig) -> float:
    """Bytes the update reads from and writes to the state file per parameter: both moments (and the FP32 master,
    ``master_on_disk``) each way (0 without the state on disk)."""
    if not cfg.state_on_disk:
        return 0.0
    return 2 * (2 * moment_bytes(cfg.optimizer_state) + (MASTER_BYTES if cfg.master_on_disk else 0))


def _state_io(b: _Builder, cfg: StepConfig, what: str, step: int, u: int, params: float, deps: list[int]) -> int:
    """One rank's read (or write) of a unit's shard record of the state on disk, on the ``disk`` lane (the I/O
    threads: no core is busy while the disk works), through DRAM by DMA."""
    nbytes = params * disk_bytes_per_param(cfg) / 2
    return b.add(Op(f"state {what}", "disk", step, u, {"disk": nbytes, "dram": nbytes}, 0.0, deps))


def _bf16_out(cfg: StepConfig) -> bool:
    """The update writes the BF16 copy (bf16-mixed with the copy kept)."""
    return cfg.precision == "bf16-mixed" and cfg.bf16_copy


def host_update_bytes(cfg: StepConfig) -> float:
    """CPU update bytes per host per step (all of that host's ranks): the host's share of every parameter."""
    per = update_bytes_per_param(4, rows=1, bf16_out=_bf16_out(cfg), optimizer_state=cfg.optimizer_state)
    if cfg.grad_route == "host_reduce":
        per = update_bytes_per_param(
            2 if cfg.precision == "bf16-mixed" else 4,
            rows=cfg.gpus,
            bf16_out=_bf16_out(cfg),
            optimizer_state=cfg.optimizer_state,
        )
    if cfg.param_route in ("replicated", "slideformer"):
        raise ValueError(f"host_update_bytes: param_route {cfg.param_route!r} is not a shared-ledger route")
    return cfg.model.total_params * cfg.state_share * per


def net_collective(kind: str, nbytes_per_rank: float, hosts: int, latency: float) -> tuple[dict[str, float], float]:
    """Per-rank network demand and latency of a ring collective between ``hosts`` hosts on a message of
    ``nbytes_per_rank`` (the rank's shard): all-reduce moves 2(N-1)/N of it over the network in 2(N-1) steps;
    reduce-scatter and all-gather move (N-1)/N in N-1 steps. The ranks of a host share its network (capacity
    ``net`` = host bandwidth / R)."""
    if hosts < 2:
        return {}, 0.0
    n = hosts
    if kind == "all_reduce":
        return {"net": 2 * (n - 1) / n * nbytes_per_rank}, 2 * (n - 1) * latency
    if kind in ("reduce_scatter", "all_gather"):
        return {"net": (n - 1) / n * nbytes_per_rank}, (n - 1) * latency
    raise ValueError(f"unknown collective {kind!r}")


def flat_collective(
    kind: str, link_kind: str, nbytes: float, ranks: int, hosts: int, link_latency: float, net_latency: float
) -> tuple[dict[str, float], float]:
    """Per-rank demand and latency of one ring collective over all ``hosts`` x ``ranks`` ranks (k of them) on a
    message of ``nbytes`` (the whole unit): every rank sends (k-1)/k of it to its ring neighbour in k-1 steps. The
    ring leaves each host once, so each host's network carries (k-1)/k of the message, shared by its R ranks
    (``net`` demand 1/R of it per rank); the other edges are in-host links. A step waits for the slower of the
    two latencies."""
    k = ranks * hosts
    if k < 2:
        return {}, 0.0
    if kind not in ("reduce_scatter", "all_gather"):
        raise ValueError(f"unknown flat collective {kind!r}")
    moved = (k - 1) / k * nbytes
    demand, _ = _collective(link_kind if ranks > 1 else "none", moved, k - 1, link_latency)
    if hosts > 1:
        demand = {**demand, "net": moved / ranks}
    return demand, (k - 1) * max(link_latency if ranks > 1 else 0.0, net_latency if hosts > 1 else 0.0)


def loss_sync_latency(gpus: int, hosts: int, profile: Profile) -> float:
    """Latency of the all-reduce of one scalar over all N R ranks (a ring: 2 (k-1) steps, each at the slower of the
    in-host and between-host latencies)."""
    k = gpus * hosts
    if k < 2:
        return 0.0
    lat = profile.link_latency_s if gpus > 1 else 0.0
    if hosts > 1:
        lat = max(lat, profile.net_latency_s)
    return 2 * (k - 1) * lat


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
    shown: str = ""  # the lane the runtime's lane traces record it on, when not ``lane`` (the thread it runs on)


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


def _in_ledger(cfg: StepConfig, unit_bytes: float) -> bool:
    """A CPU "device" computes this unit (route full) on the ledger's own range, as the runtime's residency does:
    the ledger's source is in the compute dtype (the master under 32-true, the BF16 copy under bf16-mixed) and the
    unit is large enough for ``unit_copies``."""
    if cfg.unit_copies == "always" or not (cfg.precision == "32-true" or cfg.bf16_copy):
        return False
    return cfg.unit_copies == "never" or unit_bytes >= IN_LEDGER_MIN_BYTES


def slidedp_ops(cfg: StepConfig, profile: Profile, steps: int = 2) -> list[Op]:
    """SlideDP's ops of ``steps`` consecutive steps of one rank, in lane order (list order = order within a lane);
    any system's: :func:`slidedp_lightning.steptime.ops.build_ops`."""
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
    blocking: list[int] = []  # ops the compute thread waits for before its next op (the backpressure)

    def fetch(u: int, step: int, backward: bool) -> list[int]:
        """H2D (and all-gather) of unit u, issued when the compute op W places back has finished."""
        p = us[u].params
        deps = [compute_seq[-cfg.prefetch_window]] if len(compute_seq) >= cfg.prefetch_window else []
        if not backward:
            deps += last_update.get(u, [])
        tag = "bwd" if backward else "fwd"
        sharded = cfg.param_route == "sharded" and r > 1
        hb = h2d_bytes_per_param(pb, cfg.bf16_copy, cfg.h2d_convert == "device")  # bytes per param over PCIe
        nbytes = p * hb / r if sharded else p * hb
        nbytes *= cfg.state_share  # host-sharded: the rank's 1/(N R) shard
        gathered = cfg.host_sharded or sharded  # the copy fills a shard, a gather the unit's buffer
        if profile.host_is_device and not gathered and _in_ledger(cfg, p * pb):
            return [b.add(Op(f"h2d {tag}", "h2d", step, u, {}, 0.0, deps))]  # resident once updated: no copy
        demand = _fresh({"h2d": nbytes, "dram": nbytes}, profile, nbytes if gathered else p * pb)
        if pb == 2 and not cfg.bf16_copy and cfg.h2d_convert == "host":  # read the master, write the staging
            demand["dram"] = demand.get("dram", 0.0) + 3 * nbytes
            demand["cpu"] = demand.get("cpu", 0.0) + 3 * nbytes
        ids = [b.add(Op(f"h2d {tag}", "h2d", step, u, demand, profile.copy_latency_s, deps))]
        if cfg.host_sharded:  # one ring over all N R ranks
            demand, fixed = flat_collective(
                "all_gather", profile.link_kind, p * pb, r, cfg.hosts, lat, profile.net_latency_s
            )
            ids.append(
                b.add(Op(f"all_gather_net {tag}", "h2d", step, u, _fresh(demand, profile, p * pb), fixed, [ids[-1]]))
            )
        elif sharded:
            demand, fixed = _collective(kind, p * pb * (r - 1) / r, r - 1, lat)
            ids.append(
                b.add(Op(f"all_gather {tag}", "h2d", step, u, _fresh(demand, profile, p * pb), fixed, [ids[-1]]))
            )
        return ids

    gpu_rate = profile.gpu_flops * profile.gpu_efficiency

    def compute(name: str, u: int, step: int, flops: float, deps: list[int], overhead: float | None = None) -> int:
        """A compute-lane op; its fixed overhead (``op_overhead_s`` when it has FLOPs) is host time, which on a CPU
        "device" runs on the same cores as the FLOPs: there it is work (FLOP-equivalents), elsewhere latency."""
        deps = deps + ([compute_seq[-1]] if compute_seq else []) + blocking
        blocking.clear()
        fixed = (profile.op_overhead_s if flops else 0.0) if overhead is None else overhead
        if profile.host_is_device:
            flops, fixed = flops + fixed * gpu_rate, 0.0
        i = b.add(Op(name, "compute", step, u, {"gpu": flops}, fixed, deps))
        compute_seq.append(i)
        return i

    if cfg.state_on_disk:  # the steady state: the first step's reads queue behind the step before's writes
        for v in reversed(range(n_units)):
            _state_io(b, cfg, "write", 0, v, _shard_params(cfg, us[v].params), [])
    for step in range(steps):
        offloaded: dict[int, int] = {}
        for u, unit in enumerate(us):  # forward
            ready = [i for v in (u, *unit.borrows) for i in fetch(v, step, backward=False)[-1:]]
            f = compute("forward", u, step, tok * unit.fwd_flops_per_token, ready)
            act = unit.activation
            if act.offload_ratio > 0:
                nbytes = act.retained_bytes_per_token * tok * act.offload_ratio
                offloaded[u] = b.add(Op("offload", "offload", step, u, {"d2h": nbytes, "dram": nbytes}, 0.0, [f]))
        loss = compute("loss", n_units - 1, step, 0.0, [], profile.loss_seconds(tok) + profile.loop_overhead)
        b.ops[loss].shown = "loop"  # the runtime traces units only: the loss and the loop are outside its compute spans
        if cfg.loss_sync:  # the all-reduce is latency on every machine
            b.ops[compute_seq[-1]].fixed += loss_sync_latency(cfg.gpus, cfg.hosts, profile)
        updates: dict[int, list[int]] = {}
        dispatched: list[list[int]] = []  # update ops of the units reduced so far in this backward, in order
        order = list(reversed(range(n_units)))  # the order the units are updated in (backward's)
        reads: dict[int, int] = {}  # state on disk: each unit's record read
        for u in reversed(range(n_units)):  # backward
            unit = us[u]
            ready = [i for v in (u, *unit.borrows) for i in fetch(v, step, backward=True)[-1:]]
            if u in offloaded:
                nbytes = b.ops[offloaded[u]].demand["d2h"]
                window = [compute_seq[-cfg.prefetch_window]] if len(compute_seq) >= cfg.prefetch_window else []
                ready.append(
                    b.add(
                        Op("reload", "offload", step, u, {"h2d": nbytes, "dram": nbytes}, 0.0, window + [offloaded[u]])
                    )
                )
            fwd = tok * unit.fwd_flops_per_token
            if unit.activation.recompute_fraction > 0:
                ready = [compute("recompute", u, step, fwd * unit.activation.recompute_fraction, ready)]
            done = compute("backward", u, step, fwd * profile.bwd_fwd_ratio, ready)
            pages = sum(profile.fresh_bytes(n * pb) for n in unit.matrices)
            if pages:  # autograd allocates each weight's gradient: a large one in fresh pages (CPU "device")
                done = b.add(Op("gradient pages", "compute", step, u, {"fresh": pages}, 0.0, [done]))
            m = cfg.max_units_in_flight
            gate = [dispatched[-m][-1]] if m and len(dispatched) >= m else []  # backpressure: wait for that update
            blocking.extend(gate)
            start = [done, *gate]
            if profile.host_is_device and cfg.grad_route != "host_reduce":
                start = [_issue(b, cfg, profile, unit.params, pb, u, step, start, gpu_rate)]
            if cfg.state_on_disk and not dispatched:  # the first two records of the step, read ahead
                for v in order[:2]:
                    reads[v] = _state_io(b, cfg, "read", step, v, _shard_params(cfg, us[v].params), [])
            read = (reads[u],) if cfg.state_on_disk else ()
            updates[u] = _gradient(b, cfg, profile, kind, unit.params, pb, u, step, start, read)
            dispatched.append(updates[u])
            if cfg.state_on_disk:  # written behind, the record two ahead read meanwhile (RecordStream, 4 buffers)
                _state_io(b, cfg, "write", step, u, _shard_params(cfg, unit.params), updates[u][-1:])
                k = order.index(u) + 2
                if k < len(order):
                    reads[order[k]] = _state_io(
                        b, cfg, "read", step, order[k], _shard_params(cfg, us[order[k]].params), []
                    )
        last_update = updates
    return b.ops


def _shard_params(cfg: StepConfig, p: int) -> float:
    """Parameters of a unit's shard one rank updates (its share of the host's, host-sharded or not)."""
    if cfg.param_route == "replicated":
        return float(p)
    return p / cfg.gpus * cfg.state_share


def _fresh(demand: dict[str, float], profile: Profile, alloc_bytes: float) -> dict[str, float]:
    """``demand`` of an op that writes a buffer of ``alloc_bytes`` allocated for this use: its fresh pages too."""
    fresh = profile.fresh_bytes(alloc_bytes)
    return {**demand, "fresh": fresh} if fresh else demand


def _issue(
    b: _Builder, cfg: StepConfig, profile: Profile, p: int, pb: int, u: int, step: int, deps: list[int], gpu_rate: float
) -> int:
    """On a CPU "device", the compute thread's part of a gradient route (``GradRoute._gpu_reduce``): the issue (one
    op's overhead, as work on the cores) and the flat FP32 gradient it fills (read the compute-dtype gradients,
    write a fresh buffer; divide it in place before the collective when several ranks average; chunked shards are
    made contiguous). On a GPU these run on the device and are not modelled. The traces record both on the reduce
    lane (span "issue"). Returns the fill op."""
    issue = b.add(Op("issue", "compute", step, u, {"gpu": profile.op_overhead_s * gpu_rate}, 0.0, deps, shown="reduce"))
    ranks = cfg.gpus * cfg.hosts
    nbytes = p * pb + p * 4 + (8 * p if ranks > 1 else 0)
    if cfg.chunk_bytes and cfg.gpus > 1 and cfg.param_route != "replicated":
        nbytes += 8 * p
    demand = _fresh({"h2d": nbytes, "dram": nbytes}, profile, p * 4)
    return b.add(Op("fill", "compute", step, u, demand, 0.0, [issue], shown="reduce"))


def _gradient(
    b: _Builder,
    cfg: StepConfig,
    profile: Profile,
    kind: str,
    p: int,
    pb: int,
    u: int,
    step: int,
    start: list[int],
    reads: tuple[int, ...] = (),
) -> list[int]:
    """Reduce, D2H and update ops of one unit's gradient, issued once ``start`` is done (its backward, the
    backpressure and, on a CPU device, the compute thread's issue), the update also once ``reads`` (its state
    record's read) is; returns the update ops."""
    r, lat = cfg.gpus, profile.link_latency_s
    if cfg.grad_route == "host_reduce":
        d2h = b.add(Op("d2h", "d2h", step, u, {"d2h": p * pb, "dram": p * pb}, profile.copy_latency_s, list(start)))
        nbytes = (
            p / r * update_bytes_per_param(pb, rows=r, bf16_out=_bf16_out(cfg), optimizer_state=cfg.optimizer_state)
        )
        deps = [d2h, *reads]
        return [b.add(Op("update", "update", step, u, {"cpu": nbytes, "dram": nbytes}, 0.0, deps))]
    replicated = cfg.param_route == "replicated"
    reduced = p if replicated else p / r  # parameters this rank holds after the in-host reduction
    share = reduced * cfg.state_share  # parameters this rank receives and updates
    n_chunks = max(1, math.ceil(reduced * 4 / cfg.chunk_bytes)) if cfg.chunk_bytes else 1
    per_upd = update_bytes_per_param(4, rows=1, bf16_out=_bf16_out(cfg), optimizer_state=cfg.optimizer_state)
    out = []
    for k in range(n_chunks):
        frac = 1 / n_chunks
        if cfg.host_sharded:  # one ring over all N R ranks
            demand, fixed = flat_collective(
                "reduce_scatter", profile.link_kind, p * 4 * frac, r, cfg.hosts, lat, profile.net_latency_s
            )
            red = b.add(Op("reduce_scatter_net", "reduce", step, u, demand, fixed, list(start), k))
        elif r > 1:
            # an all-reduce moves twice a reduce-scatter's bytes, except on a CPU "device": there gpu_reduce is itself
            # gloo's in-place all-reduce of the whole unit (docs/step.md), the form calibrate times, so the link rate
            # is already the all-reduce's
            twice = 2 if replicated and not profile.host_is_device else 1
            moved = twice * p * 4 * (r - 1) / r * frac
            demand, fixed = _collective(kind, moved, twice * (r - 1), lat)
            red = b.add(
                Op("all_reduce" if replicated else "reduce_scatter", "reduce", step, u, demand, fixed, list(start), k)
            )
        else:
            red = None
        if cfg.hosts > 1 and not cfg.host_sharded:  # then between the hosts, on the rank's reduced shard
            demand, fixed = net_collective("all_reduce", reduced * 4 * frac, cfg.hosts, profile.net_latency_s)
            red = b.add(
                Op("all_reduce_net", "net", step, u, demand, fixed, [red] if red is not None else list(start), k)
            )
        nbytes = share * 4 * frac
        # on a CPU "device" the update reads the collective's output in place: no copy
        d2h_demand = {} if profile.host_is_device else {"d2h": nbytes, "dram": nbytes}
        d2h = b.add(
            Op(
                "d2h",
                "d2h",
                step,
                u,
                d2h_demand,
                0.0 if profile.host_is_device else profile.copy_latency_s,
                [red] if red is not None else list(start),
                k,
            )
        )
        upd = share * frac * per_upd
        deps = [d2h, *reads] if k == 0 else [d2h]
        out.append(b.add(Op("update", "update", step, u, {"cpu": upd, "dram": upd}, 0.0, deps, k)))
    return out
