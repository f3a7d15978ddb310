"""Opening a host's ledger: its geometry from the layout, the file created by local rank 0 (or a private mapping),
handed to and mapped by every local rank, and filled (from a checkpoint by every rank, else by local rank 0).

Every function here is collective over the ranks named by the :class:`Topology`: all of them call it, in the
same order, with the same arguments.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from slidedp_lightning.runtime.config import EngineConfig
from slidedp_lightning.runtime.layout import Layout
from slidedp_lightning.runtime.ledger.disk import DiskState
from slidedp_lightning.runtime.ledger.geometry import MOMENTS, LedgerGeometry, unit_regions
from slidedp_lightning.runtime.ledger.host_ledger import HostLedger
from slidedp_lightning.runtime.ledger.initial_weights import InitialWeights, broadcast_weights
from slidedp_lightning.runtime.ledger.memory import LedgerHandle
from slidedp_lightning.runtime.ledger.preflight import check_host_memory, ledger_directory
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


def ledger_geometry(layout: Layout, config: EngineConfig, topology: Topology, dtype: torch.dtype) -> LedgerGeometry:
    """The ledger of ``layout``: every region for each unit with a trainable parameter, the moments over its
    trainable prefix only (and the FP32 master too when the device reads the BF16 copy); a wholly frozen unit keeps
    only the copy of its weights the device reads (:func:`unit_regions`)."""
    host_reduce = config.grad_route == "host_reduce"
    mode = (config.optimizer_state, config.bf16_copy)
    regions = tuple(unit_regions(not u.frozen, dtype, *mode) for u in layout.units)
    extents = tuple(u.trainable_extent for u in layout.units)
    trimmed = any(0 < e < u.padded for e, u in zip(extents, layout.units))
    on_disk: tuple[str, ...] = ()
    if config.state_dir is not None:
        on_disk = MOMENTS + (("exp_avg_absmax", "exp_avg_sq_absmax") if config.optimizer_state == "int8" else ())
    if config.master_on_disk:
        if dtype != torch.bfloat16:
            raise ValueError(
                f"the FP32 master on disk (StateOnDisk(master=True)) leaves only the BF16 copy in host memory for the "
                f"devices to read, and this run computes in {str(dtype).removeprefix('torch.')}: use "
                "precision='bf16-mixed' (or 'bf16-true'), or keep the master in memory (StateOnDisk(master=False))."
            )
        on_disk = ("master", *on_disk)
    return LedgerGeometry(
        total=layout.total,
        num_units=len(layout.units),
        world_size=topology.owners,
        staging_slots=config.staging_slots if host_reduce else 0,
        staging_elems=layout.max_unit if host_reduce else 0,
        staging_itemsize=2 if dtype == torch.bfloat16 else 4,
        unit_sizes=tuple(u.padded for u in layout.units),
        regions_of_unit=regions if any(u.frozen for u in layout.units) or not config.bf16_copy else (),
        optimizer_state=config.optimizer_state,
        trainable_sizes=extents if trimmed else (),
        trim_master=dtype == torch.bfloat16 and config.bf16_copy,
        on_disk=on_disk,
    )


def open_disk_state(geometry: LedgerGeometry, directory: str, topology: Topology) -> DiskState:
    """The host's state file of ``geometry.on_disk`` in ``directory``, created (its blocks reserved, a disk too
    small refused with the numbers) by local rank 0 and opened by every local rank."""
    if topology.host_sharded or topology.ledger_per_rank:
        raise ValueError(
            "the state on disk is one file per host shared by its ranks, holding every shard of the host's ledger: "
            "it needs host_layout='replicated' and param_route 'full' or 'sharded'."
        )
    shared = topology.ranks_per_host > 1
    created: list[DiskState] = []

    def create() -> LedgerHandle | None:
        created.append(DiskState.create(directory, geometry, share=shared))
        return created[0].handle if shared else None

    handle = on_rank0_for_all(create, topology)
    disk = created[0] if created else DiskState.open(handle, directory, geometry)  # type: ignore[arg-type]
    try:
        if topology.ledger_group is not None:
            dist.barrier(group=topology.ledger_group)
        disk.stop_sharing()
    except BaseException:
        disk.close()
        raise
    return disk


def open_ledger(
    geometry: LedgerGeometry,
    num_params: int,
    weights: InitialWeights,
    topology: Topology,
    state_dir: str | None = None,
) -> HostLedger:
    """The host's ledger, an unnamed file created by local rank 0 and opened and mapped by every local rank (it stops
    handing the file out once all have it); with a ledger per rank (replicated route) or one local rank, a private
    one (this process's memory, see :func:`ledger_directory`).

    From a checkpoint, every rank reads its share of the units into the mapped ledger
    (:meth:`InitialWeights.load`); otherwise local rank 0 copies (or initializes) them while it creates the file,
    and a private ledger receives rank 0's weights. Ranks that do not write their ledger give their own copy of the
    weights back first. The regions ``geometry.on_disk`` go to a state file in ``state_dir``, created first (a disk
    too small is refused before any weight is copied) and attached as ``ledger.disk``."""
    if geometry.on_disk and state_dir is None:
        raise ValueError(f"the ledger keeps {geometry.on_disk} on disk: open_ledger needs their state_dir")
    disk = open_disk_state(geometry, state_dir, topology) if state_dir is not None and geometry.on_disk else None
    try:
        return _open_host_ledger(geometry, num_params, weights, topology, disk)
    except BaseException:
        if disk is not None:
            disk.close()
        raise


def _open_host_ledger(
    geometry: LedgerGeometry, num_params: int, weights: InitialWeights, topology: Topology, disk: DiskState | None
) -> HostLedger:
    """:func:`open_ledger`'s file in host memory, with ``disk`` attached before any weight is written (a master on
    disk is written through it)."""
    copies = topology.ledger_copies
    weights.release_unwritten()
    by_rank0 = not weights.from_source
    shared = not topology.ledger_per_rank and topology.ranks_per_host > 1

    directory = ledger_directory(shared)

    def create() -> HostLedger:
        check_host_memory(geometry, num_params, copies, directory)
        ledger = HostLedger(directory, geometry, create=True, share=shared)
        ledger.disk = disk
        try:
            if by_rank0:
                weights.fill(ledger)
        except BaseException:
            ledger.close()
            raise
        return ledger

    if topology.ledger_per_rank:
        on_rank0_for_all(lambda: check_host_memory(geometry, num_params, copies, directory), topology)
        ledger = create()
        try:
            if by_rank0:
                if topology.world is not None:  # DDP's rule: rank 0's weights
                    broadcast_weights(ledger, topology.world, group_src=0)
                ledger.refresh_bf16()
            else:  # every rank reads the same files
                weights.load(ledger)
        except BaseException:
            ledger.close()
            raise
        ledger.pids[0] = os.getpid()
        return ledger
    created: list[HostLedger] = []

    def create_on_rank0() -> LedgerHandle | None:
        ledger = create()
        created.append(ledger)
        return ledger.handle if shared else None

    handle = on_rank0_for_all(create_on_rank0, topology)
    if created:
        ledger = created[0]
    else:
        ledger = HostLedger(handle, geometry, create=False)
        ledger.disk = disk
    try:
        ledger.pids[topology.local_rank] = os.getpid()
        if not by_rank0:
            weights.load(ledger)
        if topology.ledger_group is not None:
            dist.barrier(group=topology.ledger_group)
        ledger.stop_sharing()  # every rank has the file: nothing more to hand out
    except BaseException:
        ledger.close()
        raise
    return ledger
