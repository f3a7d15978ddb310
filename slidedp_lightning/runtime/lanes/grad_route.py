"""Lanes 4-5: gradient reduction routes and the return of the reduced gradient to the host.

``gpu_reduce``: the ranks reduce-scatter the unit's flat gradient on the device (FP32, pre-divided by R as
DDP does); each rank brings its own shard to the host and updates it.
``host_reduce``: every rank copies its whole unit gradient into its shared-memory staging slot; each owner
sums the R slots of its shard inside the update pass (host traffic x R, no device collective).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
import torch.distributed as dist

from slidedp_lightning.constants import GradRoute as GradRouteName
from slidedp_lightning.runtime.compat import reduce_scatter_into
from slidedp_lightning.runtime.lanes.flat_grads import FlatLease, FlatPool, _fill_flat, pooled_elems
from slidedp_lightning.runtime.lanes.liveness import Liveness, PeerFailure, lane_delay, wait_until
from slidedp_lightning.runtime.lanes.streams import CollectiveHandle, Lanes
from slidedp_lightning.runtime.layout import Layout
from slidedp_lightning.runtime.ledger.host_ledger import HostLedger
from slidedp_lightning.runtime.topology import Topology
from slidedp_lightning.runtime.trace import Tracer

if TYPE_CHECKING:
    from slidedp_lightning.runtime.lanes.update import GradSource

ReduceRoute = Literal[
    "gpu_reduce", "host_reduce", "all_reduce"
]  # all_reduce: the replicated baseline, every rank gets the whole gradient


WATERMARK = 1 << 32  # host_reduce stamps: generation * WATERMARK + elements of the slot written so far
# an outlier unit reduced piece by piece (GradRoute._reduce_outlier): elements of each rank's shard per piece (at
# most; and at most 1/R of the pooled buffers' size)
OUTLIER_PIECE = 1 << 22


def reduces_in_place(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether a reduce-scatter over ``group`` of tensors on ``device`` runs as an in-place all-reduce and a slice:
    host tensors on gloo.

    gloo runs a reduce-scatter as an all-reduce of a copy of its input, then copies this rank's slice out.
    All-reducing the flat gradient in place, and reading the slice once it landed, gives the same sums without a
    second full-size copy of the unit's gradient; over loopback it is also 1.5-1.8x faster (docs/STEPTIME.md).
    The route probe times this form for the same reason."""
    return device.type == "cpu" and dist.get_backend(group) == "gloo"


class _Chained:
    """A host collective that a lane thread issues once the one before it has completed (``future``'s result is
    its handle): ``wait()`` and ``is_completed()`` as for a collective's handle; a failure to issue it is raised by
    ``wait()``."""

    def __init__(self, future: Future[CollectiveHandle]) -> None:
        self.future = future

    def is_completed(self) -> bool:
        f = self.future
        return f.done() and (f.exception() is not None or f.result().is_completed())

    def wait(self) -> None:
        self.future.result().wait()


@dataclass
class ReducedShard:
    """gpu_reduce: this rank's reduced shard on the host, once its marker (D2H copy) and work are done.

    The shard lands once: the collective is waited for, the buffers it kept alive (``keep``: the flat gradient
    and the device piece under device streams; the work's own buffers) are dropped; a shard viewing a pooled
    buffer (``lease``) keeps it until :meth:`release`. Whichever thread sees it first lands it: the D2H lane as the collective completes, the compute thread at the next dispatch
    (:meth:`GradRoute.reap`) or the update lane (:meth:`get`); :meth:`release` drops the shard itself."""

    lanes: Lanes
    shard: torch.Tensor | None
    marker: object
    work: CollectiveHandle | None
    keep: tuple = ()
    step: int = -1
    unit: int = -1
    chunk: int = -1
    liveness: Liveness | None = None  # device streams: the D2H event is polled, so a dead peer cannot hang get()
    lease: FlatLease | None = None  # the pooled flat gradient the shard (or its collective) reads, until release
    issued: float = field(default_factory=time.perf_counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def _land(self) -> None:
        """With ``_lock`` held: wait for the collective (raising its error), then free what it kept alive."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        self.keep = ()

    def get(self) -> np.ndarray:
        lane_delay()
        if self.liveness is not None and not self.lanes.done(self.marker):
            wait_until(lambda: self.lanes.done(self.marker), self.liveness, "a gradient's reduction and return")
        self.lanes.host_wait(self.marker)
        with self._lock:
            self._land()
        tracer = self.lanes.tracer
        if tracer.enabled:  # from issue until the update lane has it (collective and D2H)
            tracer.record(
                "reduce", "reduce + return", self.step, self.issued, time.perf_counter(), self.unit, self.chunk
            )
        assert self.shard is not None, "get() before release()"
        return self.shard.numpy()

    def landed(self) -> bool:
        """Never blocks: land the shard if its collective has completed; True once it has landed."""
        work = self.work
        if not self.lanes.done(self.marker) or (work is not None and not work.is_completed()):
            return False
        if not self._lock.acquire(blocking=False):
            return False  # another thread is landing it
        try:
            if self.shard is not None:
                self._land()
            return True
        except Exception:  # noqa: BLE001 - the collective failed: get() on the update lane raises it
            return False
        finally:
            self._lock.release()

    def release(self) -> None:
        with self._lock:
            pending = self.work is not None  # never landed: its collective may still write the pooled buffer
            self.work, self.keep, self.shard = None, (), None
            lease, self.lease = self.lease, None
        if lease is not None:
            lease.drop(reusable=not pending)


@dataclass
class StagedSlots:
    """host_reduce: the R staging rows of one chunk [lo, hi) of a slot, once every rank has written it."""

    ledger: HostLedger
    liveness: Liveness
    shard_rank: int
    slot: int
    gen: int
    lo: int  # slot-relative (unit-relative) range of the chunk
    hi: int
    tracer: Tracer
    step: int
    unit: int
    last: bool = True  # the last chunk of this rank's shard: reading it frees the slot
    chunk: int = 0

    def get(self) -> np.ndarray:
        lane_delay()
        marks = self.ledger.grad_gen[:, self.slot]
        need = self.gen * WATERMARK + self.hi
        with self.tracer.span("reduce", "wait all ranks' slots", self.step, self.unit, self.chunk):
            wait_until(lambda: bool((marks >= need).all()), self.liveness, f"gradient slot {self.slot} of all ranks")
        staging = self.ledger.staging
        assert staging is not None, "host_reduce runs on a ledger with staging slots"
        rows = staging[:, self.slot, self.lo : self.hi]
        if rows.dtype == torch.bfloat16:
            return rows.view(torch.int16).numpy().view(np.uint16)
        return rows.numpy()

    def release(self) -> None:
        if self.last:
            self.ledger.consumed[self.shard_rank, :, self.slot] = self.gen


class GradRoute:
    """Turns one unit's local gradients into this rank's reduced-gradient source for the update lane."""

    def __init__(
        self,
        *,
        route: GradRouteName,
        layout: Layout,
        ledger: HostLedger,
        lanes: Lanes,
        liveness: Liveness,
        topology: Topology,
        chunk_elems: int | None = None,
    ) -> None:
        """``route``: the user's choice (validated by ``EngineConfig``); a ledger per rank (the replicated
        parameter route) all-reduces whole gradients instead."""
        self.route: ReduceRoute = "all_reduce" if topology.ledger_per_rank and topology.shard_world > 1 else route
        self.layout = layout
        self.ledger = ledger
        self.shard_rank = topology.shard_rank  # this rank's shard of every unit
        self.world_size = world_size = topology.shard_world
        self.group = group = topology.shard_group
        self.lanes = lanes
        self.device = lanes.device
        self.liveness = liveness
        self.tracer = lanes.tracer
        self.chunk_elems = chunk_elems  # gpu_reduce/all_reduce: elements per chunk of this rank's range; None: one
        # several hosts: the host-reduced shard is all-reduced over the same shard's owners on the other hosts
        self.cross_group = topology.cross
        self.reduce_world = topology.reduce_world  # DDP divides by every rank of the job
        if self.cross_group is not None and route == "host_reduce":
            raise ValueError(
                "grad_route='host_reduce' sums gradients inside one host's update; across several hosts "
                "use grad_route='gpu_reduce'."
            )
        if route == "host_reduce" and layout.max_unit >= WATERMARK:
            raise ValueError(
                f"grad_route='host_reduce' supports units of fewer than 2**32 elements; the largest "
                f"unit has {layout.max_unit:,}. Use grad_route='gpu_reduce'."
            )
        self._published: list[Future] = []  # host_reduce: copies to the staging slots still on the D2H lane
        self._reducing: list[ReducedShard] = []  # gpu_reduce: shards whose collective buffers may still be held
        self._in_place = route == "gpu_reduce" and world_size > 1 and reduces_in_place(group, self.device)
        self._group_rank = dist.get_rank(group) if self._in_place else self.shard_rank
        # a host "device" reuses its flat gradients (device streams have CUDA's caching allocator)
        self.pool = (
            FlatPool(pooled_elems([u.padded for u in layout.units]), self.device)
            if route != "host_reduce" and not lanes.is_stream("compute")
            else None
        )
        # units larger than the pooled buffers are reduced piece by piece (:meth:`_reduce_outlier`)
        self.pool_elems = self.pool.elems if self.pool is not None else layout.max_unit
        self._gen = 0  # host_reduce slot generations written by this rank (the same sequence on every rank)

    @property
    def grad_scale(self) -> float:
        """Factor the update applies to the gradient it reads (host_reduce averages inside the update)."""
        return 1.0 / self.world_size if self.route == "host_reduce" else 1.0

    def dispatch(self, u: int, grads: list[torch.Tensor], step: int) -> Sequence[tuple[int, int, GradSource]]:
        """Start the reduction of unit ``u``'s gradient for engine step ``step``.

        Returns ``(lo, hi, source)`` per chunk of this rank's range of the unit (shard-relative), in order:
        the update lane can start on chunk 0 while the later chunks are still being reduced or copied.
        """
        lane_delay()
        if self.route == "host_reduce":
            return self._host_reduce(u, grads, step)
        return self._gpu_reduce(u, grads, step)

    def close(self) -> None:
        """Let go of the pooled gradient buffers."""
        self._reducing.clear()
        if self.pool is not None:
            self.pool.clear()

    def chunks(self, n: int) -> list[tuple[int, int]]:
        c = self.chunk_elems or n
        return [(a, min(a + c, n)) for a in range(0, n, c)]

    def reap(self) -> None:
        """Free the flat gradients and collective buffers of every earlier unit whose shard has landed, so a unit
        waiting for the update lane holds only its reduced shard."""
        self._reducing = [s for s in self._reducing if s.shard is not None and not s.landed()]

    def _gpu_reduce(self, u: int, grads: list[torch.Tensor], step: int) -> list[tuple[int, int, ReducedShard]]:
        """Reduce-scatter (all-reduce) unit ``u``'s flat FP32 gradient; empties ``grads`` once it is copied in."""
        self.reap()
        unit = self.layout.units[u]
        r = self.world_size
        whole = r == 1 or self.route == "all_reduce"  # this rank's ledger range is the whole unit
        if self._in_place and not whole and self.cross_group is None and unit.padded > self.pool_elems:
            return self._reduce_outlier(u, grads, step)
        n = unit.padded if whole else unit.shard_numel
        chunks = self.chunks(n)
        # each chunk's shard holds the buffer
        lease = self.pool.take(len(chunks), unit.padded) if self.pool is not None else None
        if lease is not None:
            assert lease.buf is not None, "a lease just taken holds its buffer"
            flat = lease.buf[: unit.padded]
        else:
            flat = torch.empty(unit.padded, dtype=torch.float32, device=self.device)
        if whole or len(chunks) == 1:
            _fill_flat(flat, unit, grads)
        else:  # chunk-major: chunk k of every rank's shard side by side, the contiguous input of chunk k's collective
            for a, b in chunks:
                for i in range(r):
                    _fill_flat(flat, unit, grads, i * n + a, i * n + b, at=r * a + i * (b - a))
        grads.clear()  # the compute-dtype gradients are in ``flat``: free them before the collective runs
        if self.reduce_world > 1:
            flat.div_(self.reduce_world)  # pre-divided, as DDP does
        # device streams: the flat gradient must outlive the collective's kernels; on the host its pooled buffer
        # goes back once the last shard viewing it (or whose collective reads it) has been released
        streams = self.lanes.is_stream("compute")
        out = []
        for k, (a, b) in enumerate(chunks):
            work: CollectiveHandle | None = None
            inp: torch.Tensor | None = None
            if whole:
                piece = flat[a:b]
                if r > 1:
                    work = dist.all_reduce(piece, group=self.group, async_op=True)
            else:
                # chunk k of every rank's shard, side by side: rank i receives the sum of the i-th piece
                inp = flat[r * a : r * b]
                if self._in_place:
                    # host tensors only, so the flat gradient is pooled: the shard stays a view of it until the
                    # update has read it
                    work = dist.all_reduce(inp, group=self.group, async_op=True)
                    piece = inp.view(r, b - a)[self._group_rank]
                else:
                    piece = torch.empty(b - a, dtype=torch.float32, device=self.device)
                    work = reduce_scatter_into(piece, inp, group=self.group, async_op=True)
            if self.cross_group is not None:  # then across hosts, once the host's reduction is done
                if streams:  # waiting orders the D2H stream (not compute) after the host's reduction; the
                    with self.lanes.on("d2h"):  # collective between hosts is issued behind it
                        if work is not None:
                            work.wait()
                        else:  # one rank per host: the piece is the compute stream's flat gradient
                            self.lanes.wait("d2h", self.lanes.mark("compute"))
                        work = dist.all_reduce(piece, group=self.cross_group, async_op=True)
                elif work is None:
                    work = dist.all_reduce(piece, group=self.cross_group, async_op=True)
                else:  # host collectives: the D2H lane waits and issues it (in unit order on every rank)
                    work = _Chained(self.lanes.submit("d2h", self._across, work, piece))
            host, marker, work = self.lanes.to_host(piece, work)
            # ``inp`` too: NCCL (torch >= 2.8) lets go of a collective's tensors in ``work.wait()``, which only
            # orders the D2H stream; the allocator must not hand a chunk's input to the compute stream again
            # before the collective has read it
            keep = (flat, piece, inp) if streams else ()
            shard = ReducedShard(self.lanes, host, marker, work, keep, step, u, k, liveness=self.liveness, lease=lease)
            self._reducing.append(shard)
            if work is not None:  # a host-side collective: land the shard the moment it completes
                self.lanes.submit("d2h", self._settle, shard)
            out.append((a, b, shard))
        return out

    def _reduce_outlier(self, u: int, grads: list[torch.Tensor], step: int) -> list[tuple[int, int, ReducedShard]]:
        """A unit larger than the pooled buffers (a large vocabulary's embedding or untied head) on gloo: reduced
        piece by piece, two pieces in flight, each an in-place all-reduce of ``OUTLIER_PIECE`` elements of every
        rank's shard side by side, into a buffer of this rank's shard alone. The whole unit's FP32 flat gradient
        (1.24 GB a rank at a 152K vocabulary of width 2048, where the shard of 2 ranks is half of it) is never
        made; the sums are those of the whole-buffer all-reduce. The compute thread issues and waits for the pieces
        itself (every collective of the group is issued by this thread, in the same order on every rank), so it
        returns once every piece has landed."""
        unit = self.layout.units[u]
        r, n = self.world_size, unit.shard_numel
        span = min(n, OUTLIER_PIECE, max(1, self.pool_elems // r))
        shard = torch.empty(n, dtype=torch.float32, device=self.device)
        bufs = [torch.empty(r * span, dtype=torch.float32, device=self.device) for _ in range(2)]
        in_flight: list[tuple[CollectiveHandle, torch.Tensor, int, int]] = []

        def land() -> None:
            work, buf, a, b = in_flight.pop(0)
            wait_until(work.is_completed, self.liveness, "a gradient reduction")
            work.wait()
            shard[a:b].copy_(buf.view(r, b - a)[self._group_rank])

        with self.tracer.span("reduce", "reduce piece by piece", step, u):
            for k, a in enumerate(range(0, n, span)):
                b = min(a + span, n)
                if len(in_flight) == len(bufs):
                    land()
                buf = bufs[k % 2][: r * (b - a)]
                for i in range(r):  # piece [a, b) of every rank's shard, side by side
                    _fill_flat(buf, unit, grads, i * n + a, i * n + b, at=i * (b - a))
                if self.reduce_world > 1:
                    buf.div_(self.reduce_world)  # pre-divided, as DDP does
                in_flight.append((dist.all_reduce(buf, group=self.group, async_op=True), buf, a, b))
            while in_flight:
                land()
        grads.clear()
        out = []
        for k, (a, b) in enumerate(self.chunks(n)):
            host, marker, _ = self.lanes.to_host(shard[a:b], None)
            out.append((a, b, ReducedShard(self.lanes, host, marker, None, (), step, u, k, liveness=self.liveness)))
        return out

    def _across(self, work: CollectiveHandle, piece: torch.Tensor) -> CollectiveHandle:
        """D2H lane thread: wait (never on a dead peer) for the host's reduction of ``piece``, then start its
        all-reduce between the hosts; returns that collective's handle."""
        wait_until(work.is_completed, self.liveness, "a gradient reduction within the host")
        work.wait()
        return dist.all_reduce(piece, group=self.cross_group, async_op=True)

    def _settle(self, shard: ReducedShard) -> None:
        """D2H lane thread: wait (never on a dead peer) until ``shard``'s collective completed, then land it, instead
        of holding the full-size buffers until the update lane reads the shard."""
        work = shard.work
        if work is None:
            return
        try:
            wait_until(lambda: shard.work is None or work.is_completed(), self.liveness, "a gradient reduction")
        except PeerFailure:
            return  # the update lane's get() reports the failure
        shard.landed()

    def _host_reduce(self, u: int, grads: list[torch.Tensor], step: int) -> list[tuple[int, int, StagedSlots]]:
        """Wait (on the compute thread, bounding the gradients in flight) for a free staging slot, then copy
        the unit's gradient into it chunk by chunk on the D2H lane; each owner's chunk k is readable as soon as
        every rank's watermark passes it."""
        self.raise_if_failed()
        unit = self.layout.units[u]
        slots = self.ledger.geometry.staging_slots
        self._gen += 1
        gen = self._gen
        k = (gen - 1) % slots
        consumed = self.ledger.consumed[:, self.shard_rank, k]
        if not bool((consumed >= gen - slots).all()):
            with self.tracer.span("stall", "wait free slot", step, u):
                wait_until(lambda: bool((consumed >= gen - slots).all()), self.liveness, f"owners to free slot {k}")
        ready = self.lanes.mark("compute")
        # every owner's chunks in slot order: the copy order that lets each owner start as early as possible
        n = unit.shard_numel
        pieces = [(o * n + a, o * n + b) for o in range(unit.world_size) for a, b in self.chunks(n)]
        self._published = [f for f in self._published if not f.done() or f.exception() is not None]
        self._published.append(self.lanes.submit("d2h", self._publish, u, grads, k, gen, pieces, ready, step))
        s0 = unit.shard(self.shard_rank)[0]
        mine = self.chunks(n)
        return [
            (
                a,
                b,
                StagedSlots(
                    self.ledger,
                    self.liveness,
                    self.shard_rank,
                    k,
                    gen,
                    s0 + a,
                    s0 + b,
                    self.tracer,
                    step,
                    u,
                    i == len(mine) - 1,
                    i,
                ),
            )
            for i, (a, b) in enumerate(mine)
        ]

    def _publish(self, u, grads, k: int, gen: int, pieces: list[tuple[int, int]], ready, step: int) -> None:
        """D2H lane thread: copy unit ``u``'s gradient into staging slot ``k`` piece by piece, moving this rank's
        watermark ``gen * WATERMARK + end`` past each piece once it has landed."""
        lane_delay()
        lanes = self.lanes
        unit = self.layout.units[u]
        staging = self.ledger.staging
        assert staging is not None, "host_reduce runs on a ledger with staging slots"
        row = staging[self.shard_rank, k, : unit.padded]
        mark = self.ledger.grad_gen[self.shard_rank : self.shard_rank + 1, k]
        landed: list[tuple[int, object]] = []
        with lanes.on("d2h"):
            lanes.wait("d2h", ready)
            for i, (a, b) in enumerate(pieces):
                lane_delay()
                with lanes.span("d2h", "copy to slot", step, u, i):
                    _fill_flat(row, unit, grads, a, b)
                landed.append((b, lanes.mark("d2h")))
                while landed and lanes.done(landed[0][1]):  # publish what has landed while issuing the rest
                    mark[0] = gen * WATERMARK + landed.pop(0)[0]
        for g in grads:
            if g is not None:  # None: a frozen parameter
                lanes.hand_over(g, "d2h")
        for end, marker in landed:
            lanes.host_wait(marker)
            lane_delay()
            mark[0] = gen * WATERMARK + end

    @property
    def error(self) -> BaseException | None:
        """The first failure of a staging copy on the D2H lane, if any."""
        for f in self._published:
            if f.done() and f.exception() is not None:
                return f.exception()
        return None

    def raise_if_failed(self) -> None:
        err = self.error
        if err is not None:
            raise RuntimeError("SlideDP: copying a gradient to the host staging slot failed") from err
