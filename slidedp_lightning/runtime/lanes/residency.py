"""Lane 1: unit residency on the compute device, with a prefetch window.

Each unit has one flat device buffer; the model's parameters are views into it. A non-resident unit's
buffer has storage of size 0, so the unit costs no device memory. Making it resident resizes the storage
and fills it from the ledger (the FP32 master, or the BF16 transfer copy under bf16-mixed):

- route ``full``: once every owner rank has stamped the unit as updated for the current step, copy the
  whole unit host->device;
- route ``sharded``: once this rank's own shard is updated, copy that 1/R shard host->device and
  all-gather the unit across the ranks (on a process group of its own, issued from the H2D lane thread in
  the same order on every rank).

On a CPU device, a unit of at least :data:`IN_LEDGER_MIN_BYTES` whose ledger source already has the compute dtype
(the BF16 copy under bf16-mixed, the master under 32-true) and the route ``full`` is not copied at all: its buffer
is the ledger's range itself, and making it resident only waits for the update. A copy would hold a second
instance of host memory the ledger already holds (a tied 0.3 B-parameter embedding: 0.6 GB per rank). A smaller
unit is copied: its copy fits in the cache and acts as a prefetch on the H2D thread (computing on the shared
ledger in place made a 1 M-parameter job's steps slower, docs/PERFORMANCE.md).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Literal

import torch
from torch import nn

from slidedp_lightning.constants import IN_LEDGER_MIN_BYTES
from slidedp_lightning.runtime.compat import all_gather_into
from slidedp_lightning.runtime.lanes.liveness import Liveness, lane_delay, wait_until
from slidedp_lightning.runtime.lanes.streams import Lanes
from slidedp_lightning.runtime.layout import Layout
from slidedp_lightning.runtime.ledger.host_ledger import HostLedger
from slidedp_lightning.runtime.topology import Topology

log = logging.getLogger(__name__)


class UnitResidency:
    """Device buffers of all units, their reference counts and the prefetch lane."""

    def __init__(
        self,
        *,
        layout: Layout,
        ledger: HostLedger,
        lanes: Lanes,
        liveness: Liveness,
        topology: Topology,
        dtype: torch.dtype,
        window: int,
        sharded: bool = False,
        h2d_convert: Literal["host", "device"] = "host",
        copies: Literal["auto", "always", "never"] = "auto",
    ) -> None:
        """``sharded``: the sharded parameter route (own shard H2D, then an all-gather on the topology's
        ``param_group``); else every rank copies each whole unit. ``copies``: which units a CPU device computes on
        in the ledger (see the module's docstring): ``"auto"`` the large ones, ``"never"`` every one the dtype
        allows, ``"always"`` none."""
        self.layout = layout
        self.ledger = ledger
        self.lanes = lanes
        self.device = lanes.device
        self.dtype = dtype
        self.window = window
        self._alive = liveness
        self.route: Literal["full", "sharded"] = "sharded" if sharded else "full"
        self.owner = topology.owner_rank  # whose shard of each unit this rank's stamps and fills name
        self.group = topology.param_group if sharded else None
        self.tracer = lanes.tracer
        self.buffers: list[torch.Tensor] = []  # one flat buffer per unit, made by bind(), empty unless resident
        self.refs = [0] * len(layout.units)
        self.held_for_backward = [False] * len(layout.units)
        self.pending: dict[int, Future] = {}
        self.resident = [False] * len(layout.units)
        self.filled_step = [-1] * len(layout.units)  # the step whose weights a resident buffer holds
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"unsupported compute dtype {dtype}")
        # what each fill copies: the BF16 copy under bf16 compute, else (FP32 compute, or no BF16 copy kept) the
        # master, converted on the way (h2d_convert: "host" into a reused staging buffer, "device" after the copy)
        want = "bf16" if dtype == torch.bfloat16 else "master"
        sources = [ledger.region(want, u.index) for u in layout.units]
        sources = [src if src is not None else ledger.region("master", i) for i, src in enumerate(sources)]
        self._sources = [src for src in sources if src is not None]
        if len(self._sources) != len(sources):
            raise ValueError("the ledger has neither a master nor a BF16 copy of some unit")
        self.h2d_convert = h2d_convert
        # units whose buffer is the ledger's own range (CPU device, route full, source in the compute dtype)
        self.aliased = [
            copies != "always"
            and self.device.type == "cpu"
            and not sharded
            and src.dtype == dtype
            and src.numel() == unit.padded
            and (copies == "never" or unit.padded * src.element_size() >= IN_LEDGER_MIN_BYTES)
            for unit, src in zip(layout.units, self._sources)
        ]
        self._staging: torch.Tensor | None = None  # host conversion: one unit's BF16 bytes, reused
        self._staging_copied = None  # marker of the last copy that read the staging buffer
        self.resident_bytes = 0
        self.peak_resident_bytes = 0
        self._forward_mark = -1  # highest unit acquired by the current forward pass
        self.fills = [0] * len(layout.units)  # host->device copies per unit since creation
        # the last unit released by forward stays until another unit is acquired: consecutive modules of one
        # unit (norm, then lm_head) and the first backward module reuse it instead of copying it again
        self._parked: int | None = None

    def dma_sources(self) -> list[torch.Tensor]:
        """The ledger memory that fills copy to the device: each unit's source (its shard of it under the sharded
        route), except where the host converts into the staging buffer first (that buffer is pinned already)."""
        out = []
        for unit, src in zip(self.layout.units, self._sources):
            if self._stages_on_host(src):
                continue
            if self.route == "full":
                out.append(src)
            else:
                s0, s1 = unit.shard(self.owner)
                out.append(src[s0:s1])
        return out

    # -- binding the model to the flat buffers -------------------------------------------------------
    def bind(self) -> None:
        """Replace every parameter of the model by a view into its unit's device buffer.

        One unit at a time: a view needs its storage at full size when it is made, so each buffer is allocated,
        viewed and emptied before the next, and the device never holds more than one unit here (all units at
        once would be the whole model, which is what this system exists not to need)."""
        if self.buffers:
            raise RuntimeError("the model is already bound to this residency")
        for unit, src, aliased in zip(self.layout.units, self._sources, self.aliased):
            if aliased:  # its own version counter: the ledger's other writers are no in-place edits to autograd
                buf = _alias(src.untyped_storage(), int(src.storage_offset()), unit.padded, self.dtype)
            else:
                buf = torch.empty(unit.padded, dtype=self.dtype, device=self.device)
            for slot in unit.slots:
                view = buf[slot.offset : slot.end].view(slot.shape)
                param = nn.Parameter(view, requires_grad=slot.trainable)
                for module, attr in slot.locations:
                    setattr(module, attr, param)
            if not aliased:
                buf.untyped_storage().resize_(0)  # views keep their geometry; the memory goes until acquire
            self.buffers.append(buf)
        if self.device.type == "cuda":
            # the emptied blocks are cached for the current stream, which fills (on the h2d stream) cannot reuse
            torch.cuda.empty_cache()

    def unbind(self, restore: bool) -> None:
        """Give the model ordinary parameters again: FP32 copies of the master (of the BF16 copy for a unit
        without one), or meta tensors. The parameters it replaces (an optimizer may still hold them) keep their
        geometry over empty storage, as a copied unit's do while not resident."""
        for unit, aliased in zip(self.layout.units, self.aliased):
            if aliased:  # else they would keep the ledger's mapping (the whole ledger) alive after close
                self._off_ledger(unit)
        for unit in self.layout.units:
            weights = self.ledger.weights(unit.index) if restore else None
            for slot in unit.slots:
                if weights is not None:
                    data = weights[slot.offset : slot.end].clone().view(slot.shape)
                else:
                    data = torch.empty(slot.shape, device="meta")
                param = nn.Parameter(data, requires_grad=slot.trainable)
                for module, attr in slot.locations:
                    setattr(module, attr, param)
        self.buffers = []  # an aliased buffer would keep the ledger's mapping alive

    def _off_ledger(self, unit) -> None:
        """Point ``unit``'s parameters, views of the ledger, at an emptied buffer of their own."""
        own = torch.empty(unit.padded, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for slot in unit.slots:
                module, attr = slot.locations[0]
                getattr(module, attr).set_(own.untyped_storage(), slot.offset, slot.shape)
        own.untyped_storage().resize_(0)

    def resident_storages(self) -> list[int]:
        """Data pointers of the resident units' device buffers (saved parameters are views of these)."""
        return [b.untyped_storage().data_ptr() for b, res in zip(self.buffers, self.resident) if res]

    def param(self, unit_index: int, slot_index: int) -> torch.Tensor:
        slot = self.layout.units[unit_index].slots[slot_index]
        module, attr = slot.locations[0]
        return getattr(module, attr)

    # -- residency -----------------------------------------------------------------------------------
    def _fill(self, u: int, step: int):
        """Runs on the H2D lane thread: wait for the updates this route reads, then fill ``u``'s device buffer.

        Returns the marker the compute lane waits on before using the unit."""
        unit = self.layout.units[u]
        version = self.ledger.version[u]
        if self.route == "sharded":
            ready = lambda: bool(version[self.owner] >= step)  # noqa: E731  (the other shards come by all-gather)
        else:
            ready = lambda: bool((version >= step).all())  # noqa: E731
        wait_until(ready, self._alive, f"update of unit {unit.name}")
        lane_delay()
        self.fills[u] += 1
        lanes = self.lanes
        if self.aliased[u]:  # the buffer is the ledger's range: the update it waited for is all there is to do
            return lanes.mark("h2d")
        src = self._sources[u]
        with lanes.on("h2d"):
            # memory allocated here belongs to the H2D lane: a block the compute lane freed is handed out only
            # once the compute work recorded on it is done, so no wait on the compute lane is needed
            storage = self.buffers[u].untyped_storage()
            storage.resize_(unit.padded * self.buffers[u].element_size())
            # an alias with its own version counter: refilling must not look like an in-place edit to autograd,
            # which saved these parameters for backward
            buf = _alias(storage, 0, unit.padded, self.dtype)
            if self.route == "full":
                with lanes.span("h2d", "copy", step, u):
                    self._copy(buf, src)
                return lanes.mark("h2d")
            s0, s1 = unit.shard(self.owner)
            shard = torch.empty(s1 - s0, dtype=self.dtype, device=self.device)
            with lanes.span("h2d", "copy shard", step, u):
                self._copy(shard, src[s0:s1])
            copied = lanes.mark("h2d")
        lane_delay()
        with lanes.on("comm"), lanes.span("h2d", "all_gather", step, u, on="comm"):
            lanes.wait("comm", copied)
            all_gather_into(buf, shard, group=self.group)
        lanes.hand_over(shard, "comm")
        lanes.hand_over(buf, "comm")
        return lanes.mark("comm")

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Host ledger -> device buffer, on the H2D lane. Without a BF16 copy in the ledger the FP32 master is
        converted on the way: on the host into a reused (pinned) staging buffer, then copied (2 B/param over the
        link), or (``h2d_convert="device"``) copied as FP32 and converted by the device (4 B/param)."""
        if not self._stages_on_host(src):
            dst.copy_(src, non_blocking=True)
            return
        if self._staging is None:  # pinned on CUDA: the copy out of it is async DMA
            self._staging = self.lanes.pinned(self.layout.max_unit, dst.dtype)
        if self._staging_copied is not None:  # the previous copy out of the staging buffer must be done
            self.lanes.host_wait(self._staging_copied)
        stage = self._staging[: src.numel()]
        stage.copy_(src)  # round-to-nearest-even, the bits the update kernel writes into a BF16 copy
        dst.copy_(stage, non_blocking=True)
        self._staging_copied = self.lanes.mark("h2d")

    def _stages_on_host(self, src: torch.Tensor) -> bool:
        """A fill from ``src`` converts it on the host into the staging buffer first (then copies that)."""
        return src.dtype != self.dtype and self.h2d_convert == "host"

    def _start(self, u: int, step: int) -> None:
        if self.resident[u] and self.filled_step[u] < step and self.refs[u] == 0 and not self.held_for_backward[u]:
            if self._parked == u:  # parked before an optimizer step: it holds the previous step's weights
                self._parked = None
            self._maybe_evict(u)
        if not self.resident[u] and u not in self.pending:
            self.pending[u] = self.lanes.submit("h2d", self._fill, u, step)
            self.filled_step[u] = step

    def _finish(self, u: int, step: int) -> None:
        fut = self.pending.pop(u, None)
        if fut is None:
            return
        if self.tracer.enabled and not fut.done():
            with self.tracer.span("stall", "wait h2d", step, u):
                marker = fut.result()
        else:
            marker = fut.result()
        self.lanes.wait("compute", marker)
        self.resident[u] = True
        self.resident_bytes += self._device_bytes(u)
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)

    def acquire(self, units: tuple[int, ...], step: int, backward: bool) -> None:
        """Make ``units`` resident (blocking), then start prefetching the next ones in this direction."""
        if self._parked is not None and self._parked not in units:
            parked, self._parked = self._parked, None
            self._maybe_evict(parked)
        for u in units:
            self._start(u, step)
        for u in units:
            self._finish(u, step)
            if backward:
                self.held_for_backward[u] = True
            else:
                self.refs[u] += 1
        if backward:
            last, direction = min(units), -1
        else:
            # a unit re-used late in the pass (a tied lm_head borrowing the embedding) starts no prefetch
            if max(units) <= self._forward_mark:
                return
            last, direction = max(units), 1
            self._forward_mark = last
        for k in range(1, self.window):
            nxt = last + direction * k
            if 0 <= nxt < len(self.buffers):
                self._start(nxt, step)

    def begin_forward(self) -> None:
        """A new forward pass of the model starts: prefetch restarts from the first unit."""
        self._forward_mark = -1

    def release(self, units: tuple[int, ...]) -> None:
        """Drop forward references; a unit with none left (and not held for backward) leaves the device."""
        for u in units:
            self.refs[u] -= 1
            if self.refs[u] == 0 and not self.held_for_backward[u]:
                if self._parked is not None and self._parked != u:
                    self._maybe_evict(self._parked)
                self._parked = u

    def release_backward(self, u: int) -> None:
        self.held_for_backward[u] = False
        if self._parked == u:
            self._parked = None
        self._maybe_evict(u)

    def _maybe_evict(self, u: int) -> None:
        if self.refs[u] > 0 or self.held_for_backward[u] or not self.resident[u]:
            return
        self.resident[u] = False
        self.resident_bytes -= self._device_bytes(u)
        if self.aliased[u]:
            return
        buf = self.buffers[u]
        self.lanes.hand_over(buf, "compute")  # the compute lane may still read it: the allocator must wait
        buf.untyped_storage().resize_(0)

    def _device_bytes(self, u: int) -> int:
        """Device memory unit ``u``'s buffer holds while resident (none when it is the ledger's range)."""
        buf = self.buffers[u]
        return 0 if self.aliased[u] else buf.numel() * buf.element_size()

    def evict_all(self) -> None:
        self._parked = None
        for u in list(self.pending):
            self._finish(u, -1)
        for u in range(len(self.buffers)):
            self.refs[u] = 0
            self.held_for_backward[u] = False
            self._maybe_evict(u)


def _alias(storage: torch.UntypedStorage, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of ``numel`` elements of ``storage`` from element ``offset`` with a version counter of its own
    (a view would share its base's: any in-place write into the base would then invalidate what autograd saved)."""
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, (numel,), (1,))
