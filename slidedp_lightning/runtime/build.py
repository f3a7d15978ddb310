"""Setting an engine up: "auto" routes resolved by measurement, the host ledger created, filled and mapped.

Every function here is collective over the ranks named by the :class:`Topology`: all of them call it, in the
same order, with the same arguments.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from slidedp_lightning.models.adapter import ArchitectureAdapter
from slidedp_lightning.runtime.config import EngineConfig
from slidedp_lightning.runtime.host_state import (
    HostLedger,
    LedgerGeometry,
    check_host_memory,
    ledger_path,
    remove_stale_ledgers,
)
from slidedp_lightning.runtime.layout import Layout, Unit
from slidedp_lightning.runtime.probe import RouteProbe, probe_routes
from slidedp_lightning.runtime.topology import Topology

log = logging.getLogger(__name__)

T = TypeVar("T")


def on_rank0_for_all(fn: Callable[[], T], topology: Topology) -> T:
    """Run ``fn`` on local rank 0; every rank of the host receives its result or raises its error (no rank
    waits forever for a rank that failed)."""
    result: list[Any] = [None]
    if topology.local_rank == 0:
        try:
            result[0] = ("ok", fn())
        except Exception as exc:  # re-raised on every rank below
            result[0] = ("error", exc)
    if topology.ranks_per_host > 1:
        dist.broadcast_object_list(result, group=topology.host_group, group_src=0)
    status, value = result[0]
    if status == "error":
        raise value
    return value


def resolve_auto_routes(
    config: EngineConfig, topology: Topology, layout: Layout, device: torch.device, dtype: torch.dtype
) -> tuple[EngineConfig, RouteProbe | None]:
    """Replace every "auto" of ``config`` by the route the probe measured fastest (the same on every rank)."""
    want = (config.param_route == "auto", config.grad_route == "auto", config.chunk_bytes == "auto")
    if not any(want):
        return config, None
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


def ledger_geometry(layout: Layout, config: EngineConfig, topology: Topology, dtype: torch.dtype) -> LedgerGeometry:
    host_reduce = config.grad_route == "host_reduce"
    return LedgerGeometry(
        total=layout.total,
        num_units=len(layout.units),
        world_size=topology.owners,
        staging_slots=config.staging_slots if host_reduce else 0,
        staging_elems=layout.max_unit if host_reduce else 0,
        staging_itemsize=2 if dtype == torch.bfloat16 else 4,
    )


class InitialWeights:
    """Writes the model's weights into a new ledger, materializing meta-device units one at a time."""

    def __init__(self, model: nn.Module, adapter: ArchitectureAdapter, layout: Layout, topology: Topology) -> None:
        self.model, self.adapter, self.layout, self.topology = model, adapter, layout, topology

    def host_ranges(self) -> list[tuple[int, int]] | None:
        """Host-sharded: the ledger elements ``[a, b)`` of each unit that this host holds; else None (all)."""
        if not self.topology.host_sharded:
            return None
        owners = self.topology.host_owners
        return [
            (u.offset + owners.start * u.shard_numel, u.offset + owners.stop * u.shard_numel) for u in self.layout.units
        ]

    def fill(self, ledger: HostLedger) -> None:
        """Copy the weights in (a new file reads as zeros: moments, gaps and padding need no writing); with
        several hosts every host receives global rank 0's weights."""
        ranges = self.host_ranges()
        leaders = self.topology.leaders
        if ranges is None:
            for unit in self.layout.units:
                self._copy_unit(unit, ledger.master[unit.offset : unit.offset + unit.padded])
            if leaders is not None:
                dist.broadcast(ledger.master, src=0, group=leaders)
        else:  # each host keeps only its slice of global rank 0's weights, received one unit at a time
            for unit, (a, b) in zip(self.layout.units, ranges):
                flat = torch.zeros(unit.padded)
                self._copy_unit(unit, flat)
                if leaders is not None:
                    dist.broadcast(flat, src=0, group=leaders)
                ledger.master[a:b].copy_(flat[a - unit.offset : b - unit.offset])
        ledger.refresh_bf16(ranges)

    def _copy_unit(self, unit: Unit, flat: torch.Tensor) -> None:
        """Write ``unit``'s weights into its flat layout ``flat`` (meta modules materialized for the copy only)."""
        materialized = []
        for slot in unit.slots:
            module, attr = slot.locations[0]
            if getattr(module, attr).is_meta:
                self._materialize(module)
                materialized.append(module)
            flat[slot.offset : slot.end].copy_(getattr(module, attr).detach().reshape(-1))
        for module in materialized:  # the unit lives in the ledger now: hand its memory back at once
            module.to_empty(device="meta", recurse=True)

    def _materialize(self, module: nn.Module) -> None:
        module.to_empty(device="cpu", recurse=True)
        with torch.no_grad():
            self.adapter.init_weights(self.model, module)


def open_ledger(geometry: LedgerGeometry, num_params: int, weights: InitialWeights, topology: Topology) -> HostLedger:
    """The host's ledger, created and filled by local rank 0 and mapped by every local rank, its name unlinked
    once all have mapped it; with a ledger per rank (replicated route), a private one holding rank 0's weights."""
    copies = topology.ledger_copies

    def create() -> tuple[str, HostLedger]:
        remove_stale_ledgers()  # before the preflight: a dead job's ledger may hold the room this one needs
        check_host_memory(geometry, num_params, copies)
        job = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT") or "local"
        path = ledger_path(topology.ledger_name(job))
        ledger = HostLedger(path, geometry, create=True)
        try:
            weights.fill(ledger)
        except BaseException:
            ledger.close()
            raise
        return path, ledger

    if topology.ledger_per_rank:
        on_rank0_for_all(lambda: check_host_memory(geometry, num_params, copies), topology)
        _, ledger = create()
        ledger.unlink()
        if topology.world is not None:  # DDP's rule: rank 0's weights
            dist.broadcast(ledger.master, group=topology.world, group_src=0)
        ledger.refresh_bf16()
        ledger.pids[0] = os.getpid()
        return ledger
    created: list[HostLedger] = []

    def create_on_rank0() -> str:
        path, ledger = create()
        created.append(ledger)
        return path

    path = on_rank0_for_all(create_on_rank0, topology)
    ledger = created[0] if created else HostLedger(path, geometry, create=False)
    try:
        ledger.pids[topology.local_rank] = os.getpid()
        if topology.ledger_group is not None:
            dist.barrier(group=topology.ledger_group)
        ledger.unlink()  # every rank has mapped it: the name is no longer needed
    except BaseException:
        ledger.close()
        raise
    return ledger
