"""The route probe behind ``"auto"``: measure each candidate route on this machine, with all ranks at once.

Every rank runs the same timed operations on the largest unit at the same moment (so shared PCIe / DRAM
bandwidth is contended as in training); the per-rank medians are max-reduced, so every rank decides from
the same numbers and picks the same routes.

- parameters: ``full`` = H2D of the whole unit; ``sharded`` = H2D of this rank's shard + all-gather.
- gradients: ``gpu_reduce`` = reduce-scatter of the FP32 unit gradient + D2H of this rank's shard (on gloo host
  tensors, the runtime's in-place all-reduce and its slice: :func:`~slidedp_lightning.runtime.lanes.grad_route.
  reduces_in_place`);
  ``host_reduce`` = D2H of the whole unit gradient into host memory + reading the R slots of one shard.
- chunks (gpu_reduce): the smallest chunk whose reduce-scatter costs at most 10 % more per byte than one
  chunk per unit; ``None`` when no smaller chunk qualifies.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist

from slidedp_lightning.runtime.compat import all_gather_into, reduce_scatter_into
from slidedp_lightning.runtime.config import EngineConfig
from slidedp_lightning.runtime.lanes.grad_route import reduces_in_place
from slidedp_lightning.runtime.layout import Layout
from slidedp_lightning.runtime.topology import Topology

log = logging.getLogger(__name__)

REPEATS = 3
CHUNK_TOLERANCE = 1.10


@dataclass
class RouteProbe:
    """Measured seconds per operation (max over ranks) and the routes they chose."""

    unit_elems: int
    seconds: dict[str, float] = field(default_factory=dict)
    param_route: str = "full"
    grad_route: str = "gpu_reduce"
    chunk_bytes: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device, group) -> float:
    """Median of REPEATS runs after one warm-up, all ranks starting together."""
    fn()
    times = []
    for _ in range(REPEATS):
        if group is not None:
            dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def probe_routes(
    source: torch.Tensor,
    unit_elems: int,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    dtype: torch.dtype,
    group,
    param_group,
    want_param: bool,
    want_grad: bool,
    want_chunks: bool,
) -> RouteProbe:
    """Measure the candidate routes on a unit of ``unit_elems`` elements read from ``source`` (the ledger)."""
    r = world_size
    shard = unit_elems // r
    lo, hi = rank * shard, (rank + 1) * shard
    src = source[:unit_elems]
    dev_unit = torch.empty(unit_elems, dtype=dtype, device=device)
    dev_shard = torch.empty(shard, dtype=dtype, device=device)
    pin = device.type == "cuda"
    result = RouteProbe(unit_elems)
    t = result.seconds
    if want_param:
        t["param_full"] = _timed(lambda: dev_unit.copy_(src, non_blocking=pin), device, group)

        def sharded() -> None:
            dev_shard.copy_(src[lo:hi], non_blocking=pin)
            all_gather_into(dev_unit, dev_shard, group=param_group)

        t["param_sharded"] = _timed(sharded, device, group)
    # zeros: the in-place form sums into its input again at every repeat
    grad = torch.zeros(unit_elems, dtype=torch.float32, device=device)
    out = torch.empty(shard, dtype=torch.float32, device=device)
    host_shard = torch.empty(shard, dtype=torch.float32, pin_memory=pin)
    in_place = r > 1 and reduces_in_place(group, device)
    me = dist.get_rank(group) if in_place else rank

    def reduce(o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """This rank's sums of ``g``'s r slices, as the runtime reduces them: in ``o``, or (in place) a view of ``g``."""
        if in_place:
            dist.all_reduce(g, group=group)
            return g.view(r, -1)[me]
        reduce_scatter_into(o, g, group=group)
        return o

    if want_grad:
        t["grad_gpu_reduce"] = _timed(lambda: host_shard.copy_(reduce(out, grad)), device, group)
        host_unit = torch.empty(unit_elems, dtype=dtype, pin_memory=pin)
        rows = torch.zeros(r, shard, dtype=dtype)  # zeros: garbage (denormals, NaN) would distort the timing
        acc = torch.empty(shard, dtype=torch.float32)
        t["grad_host_reduce"] = _timed(
            lambda: (host_unit.copy_(grad), torch.sum(rows, dim=0, dtype=torch.float32, out=acc)), device, group
        )
    if want_chunks:
        whole = _timed(lambda: reduce(out, grad), device, group)
        t["chunk_whole"] = whole
        for parts in (8, 4, 2):
            c = shard // parts
            if c < 1024:
                continue
            pieces = [(grad[: c * r], out[:c]) for _ in range(parts)]

            def chunked(p: list[tuple[torch.Tensor, torch.Tensor]] = pieces) -> None:
                for g, o in p:
                    reduce(o, g)

            secs = _timed(chunked, device, group)
            t[f"chunk_1/{parts}"] = secs
    # every rank decides from the slowest rank's numbers
    names = sorted(t)
    if group is not None:
        vec = torch.tensor([t[n] for n in names], dtype=torch.float64)
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
        t.update(zip(names, vec.tolist()))
    if want_param:
        result.param_route = "sharded" if t["param_sharded"] < t["param_full"] else "full"
    if want_grad:
        result.grad_route = "host_reduce" if t["grad_host_reduce"] < t["grad_gpu_reduce"] else "gpu_reduce"
    if want_chunks:
        fits = [p for p in (8, 4, 2) if f"chunk_1/{p}" in t and t[f"chunk_1/{p}"] <= CHUNK_TOLERANCE * t["chunk_whole"]]
        result.chunk_bytes = (shard // max(fits)) * 4 if fits else None
    return result


def resolve_auto_routes(
    config: EngineConfig, topology: Topology, layout: Layout, device: torch.device, dtype: torch.dtype
) -> tuple[EngineConfig, RouteProbe | None]:
    """Replace every "auto" of ``config`` (one at least: ``config.auto_routes``) by the route the probe measured
    fastest (the same on every rank)."""
    assert config.auto_routes, "nothing to resolve"
    want = (config.param_route == "auto", config.grad_route == "auto", config.chunk_bytes == "auto")
    if topology.shard_world == 1:
        log.info("SlideDP auto routes: one rank, nothing to choose: full / gpu_reduce / one chunk per unit")
        resolved = replace(
            config,
            param_route="full" if want[0] else config.param_route,
            grad_route="gpu_reduce" if want[1] else config.grad_route,
            chunk_bytes=None if want[2] else config.chunk_bytes,
        )
        return resolved, None
    if want[0] and topology.param_group is None:
        raise ValueError(
            "param_route='auto' measures the sharded route on a group of its own: build the Topology "
            "with param_group=True."
        )
    scratch = torch.zeros(layout.max_unit, dtype=dtype, pin_memory=device.type == "cuda")
    probe = probe_routes(
        scratch,
        layout.max_unit,
        rank=topology.shard_rank,
        world_size=topology.shard_world,
        device=device,
        dtype=dtype,
        group=topology.shard_group,
        param_group=topology.param_group,
        want_param=want[0],
        want_grad=want[1],
        want_chunks=want[2],
    )
    resolved = replace(
        config,
        param_route=probe.param_route if want[0] else config.param_route,
        grad_route=probe.grad_route if want[1] else config.grad_route,
        chunk_bytes=probe.chunk_bytes if want[2] else config.chunk_bytes,
    )
    measured = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(probe.seconds.items()))
    log.log(
        logging.INFO if topology.global_rank == 0 else logging.DEBUG,
        "SlideDP auto routes on a %s-element unit, all %d ranks at once (max over ranks): %s -> param_route=%s, "
        "grad_route=%s, chunk_bytes=%s",
        f"{layout.max_unit:,}",
        topology.shard_world,
        measured,
        resolved.param_route,
        resolved.grad_route,
        resolved.chunk_bytes,
    )
    return resolved, probe
