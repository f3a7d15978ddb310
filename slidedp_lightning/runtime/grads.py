"""Lanes 4-5: gradient reduction routes and the return of the reduced gradient to the host.

``gpu_reduce``: the ranks reduce-scatter the unit's flat gradient on the device (FP32, pre-divided by R as
DDP does); each rank brings its own shard to the host and updates it.
``host_reduce``: every rank copies its whole unit gradient into its shared-memory staging slot; each owner
sums the R slots of its shard inside the update pass (host traffic x R, no device collective).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from slidedp_lightning.runtime.comm import reduce_scatter_into
from slidedp_lightning.runtime.host_state import HostLedger
from slidedp_lightning.runtime.layout import Layout, Unit
from slidedp_lightning.runtime.sync import Liveness, lane_delay, wait_until
from slidedp_lightning.runtime.trace import Tracer

GRAD_ROUTES = ("gpu_reduce", "host_reduce")
ROUTES = GRAD_ROUTES + ("all_reduce",)  # all_reduce: the replicated baseline, every rank gets the whole gradient


def _fill_flat(flat: torch.Tensor, unit: Unit, grads: list[torch.Tensor]) -> None:
    """Write a unit's parameter gradients into its flat layout, zeroing alignment gaps and padding."""
    for a, b in unit.gaps():
        flat[a:b].zero_()
    for slot, g in zip(unit.slots, grads):
        flat[slot.offset : slot.end].copy_(g.reshape(-1), non_blocking=True)


@dataclass
class ReducedShard:
    """gpu_reduce: this rank's reduced shard, once the collective (and on CUDA the D2H copy) is done."""

    work: object | None
    shard: torch.Tensor
    event: torch.cuda.Event | None
    keep: tuple = ()
    tracer: Tracer | None = None
    step: int = -1
    unit: int = -1
    issued: float = field(default_factory=time.perf_counter)

    def get(self) -> np.ndarray:
        lane_delay()
        if self.work is not None:
            self.work.wait()
            if self.tracer is not None:  # from issue to completion, as seen by the update lane
                self.tracer.record("reduce", "reduce_scatter", self.step, self.issued, time.perf_counter(), self.unit)
        if self.event is not None:
            self.event.synchronize()
        return self.shard.numpy()

    def release(self) -> None:
        self.keep = ()


@dataclass
class StagedSlots:
    """host_reduce: the R staging rows of this rank's shard, once every rank has published them."""

    ledger: HostLedger
    liveness: Liveness
    rank: int
    slot: int
    gen: int
    lo: int
    hi: int
    tracer: Tracer
    step: int
    unit: int

    def get(self) -> np.ndarray:
        lane_delay()
        gens = self.ledger.grad_gen[:, self.slot]
        with self.tracer.span("reduce", "wait all ranks' slots", self.step, self.unit):
            wait_until(lambda: bool((gens == self.gen).all()), self.liveness, f"gradient slot {self.slot} of all ranks")
        rows = self.ledger.staging[:, self.slot, self.lo : self.hi]
        if rows.dtype == torch.bfloat16:
            return rows.view(torch.int16).numpy().view(np.uint16)
        return rows.numpy()

    def release(self) -> None:
        self.ledger.consumed[self.rank, :, self.slot] = self.gen


class GradRoute:
    """Turns one unit's local gradients into this rank's reduced-gradient source for the update lane."""

    def __init__(
        self,
        route: str,
        layout: Layout,
        ledger: HostLedger,
        rank: int,
        world_size: int,
        group,
        device: torch.device,
        liveness: Liveness,
        tracer: Tracer | None = None,
        chunk_elems: int | None = None,
    ) -> None:
        if route not in ROUTES:
            raise ValueError(f"grad_route must be one of {GRAD_ROUTES}, got {route!r}")
        self.route = route
        self.layout = layout
        self.ledger = ledger
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.device = device
        self.liveness = liveness
        self.tracer = tracer or Tracer(None, rank)
        self.chunk_elems = chunk_elems  # gpu_reduce/all_reduce: elements per chunk of this rank's range; None: one
        self._cuda = device.type == "cuda"
        self._d2h = torch.cuda.Stream(device) if self._cuda else None
        self._gen = 0  # host_reduce slot generations written by this rank (the same sequence on every rank)

    @property
    def grad_scale(self) -> float:
        """Factor the update applies to the gradient it reads (host_reduce averages inside the update)."""
        return 1.0 / self.world_size if self.route == "host_reduce" else 1.0

    def dispatch(self, u: int, grads: list[torch.Tensor], step: int) -> list[tuple[int, int, object]]:
        """Start the reduction of unit ``u``'s gradient for engine step ``step``.

        Returns ``(lo, hi, source)`` per chunk of this rank's range of the unit (shard-relative), in order:
        the update lane can start on chunk 0 while the later chunks are still being reduced.
        """
        lane_delay()
        if self.route == "host_reduce":
            staged = self._host_reduce(u, grads, step)
            return [(0, staged.hi - staged.lo, staged)]
        return self._gpu_reduce(u, grads, step)

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        c = self.chunk_elems or n
        return [(a, min(a + c, n)) for a in range(0, n, c)]

    def _gpu_reduce(self, u: int, grads: list[torch.Tensor], step: int) -> list[tuple[int, int, ReducedShard]]:
        unit = self.layout.units[u]
        flat = torch.empty(unit.padded, dtype=torch.float32, device=self.device)
        _fill_flat(flat, unit, grads)
        r = self.world_size
        whole = r == 1 or self.route == "all_reduce"  # this rank's ledger range is the whole unit
        n = unit.padded if whole else unit.shard_numel
        if r > 1:
            flat.div_(r)  # pre-divided, as DDP does
        traced = self.tracer if self.tracer.enabled else None
        out = []
        for k, (a, b) in enumerate(self._chunks(n)):
            work = None
            if whole:
                piece = flat[a:b]
                if r > 1:
                    work = dist.all_reduce(piece, group=self.group, async_op=True)
            else:
                # chunk k of every rank's shard, side by side: rank i receives the sum of the i-th piece
                inp = flat if (a, b) == (0, n) else flat.view(r, n)[:, a:b].contiguous().view(-1)
                piece = torch.empty(b - a, dtype=torch.float32, device=self.device)
                work = reduce_scatter_into(piece, inp, group=self.group, async_op=True)
            if not self._cuda:
                out.append((a, b, ReducedShard(work, piece, None, (flat,), traced, step, u)))
                continue
            if work is not None:
                work.wait()  # orders the compute stream after the collective
            host = torch.empty(b - a, dtype=torch.float32, pin_memory=True)
            self._d2h.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._d2h):
                host.copy_(piece, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._d2h)
            piece.record_stream(self._d2h)
            out.append((a, b, ReducedShard(None, host, event, (flat, piece), traced, step, u)))
        return out

    def _host_reduce(self, u: int, grads: list[torch.Tensor], step: int) -> StagedSlots:
        unit = self.layout.units[u]
        slots = self.ledger.geometry.staging_slots
        self._gen += 1
        gen = self._gen
        k = (gen - 1) % slots
        consumed = self.ledger.consumed[:, self.rank, k]
        if not bool((consumed >= gen - slots).all()):
            with self.tracer.span("stall", "wait free slot", step, u):
                wait_until(lambda: bool((consumed >= gen - slots).all()), self.liveness, f"owners to free slot {k}")
        row = self.ledger.staging[self.rank, k, : unit.padded]
        with self.tracer.span("d2h", "copy to slot", step, u):
            _fill_flat(row, unit, grads)
            if self._cuda:
                torch.cuda.current_stream(self.device).synchronize()
        lane_delay()
        self.ledger.grad_gen[self.rank, k] = gen
        lo, hi = unit.shard(self.rank)
        return StagedSlots(self.ledger, self.liveness, self.rank, k, gen, lo, hi, self.tracer, step, u)
