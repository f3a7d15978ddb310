"""Lane 6: the CPU update of this rank's shard of each unit, on a worker thread, as gradients land."""

from __future__ import annotations

import enum
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict

import numpy as np
import torch

from cpu_ops import accumulate, adamw8_update, adamw_update, adamw_update_sum, set_kernel_threads, warmup
from cpu_ops.adamw8 import QUANT_BLOCK
from slidedp_lightning.runtime.lanes.liveness import lane_delay
from slidedp_lightning.runtime.layout import Layout, Unit
from slidedp_lightning.runtime.ledger.disk import Record
from slidedp_lightning.runtime.ledger.geometry import ALL_REGIONS
from slidedp_lightning.runtime.ledger.host_ledger import HostLedger
from slidedp_lightning.runtime.topology import Topology
from slidedp_lightning.runtime.trace import Tracer

log = logging.getLogger(__name__)

_UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")


class UnsupportedOptimizerError(ValueError):
    """The user's optimizer cannot be run by the SlideDP CPU update."""


@dataclass(frozen=True)
class AdamHyper:
    """Hyper-parameters of one param group, read live from the user's optimizer at dispatch time."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool


def validate_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise a clear error unless ``optimizer`` is a torch Adam/AdamW the CPU kernels implement exactly."""
    kind = type(optimizer)
    if kind not in (torch.optim.AdamW, torch.optim.Adam):
        raise UnsupportedOptimizerError(
            f"SlideDP runs the optimizer on the CPU and supports torch.optim.AdamW and torch.optim.Adam; "
            f"configure_optimizers returned {kind.__module__}.{kind.__qualname__}. Return an AdamW/Adam instead."
        )
    for i, group in enumerate(optimizer.param_groups):
        bad = [f for f in _UNSUPPORTED_FLAGS if group.get(f)]
        if bad:
            raise UnsupportedOptimizerError(
                f"param group {i} of {kind.__name__} sets {bad}; SlideDP's CPU update does not implement "
                f"{', '.join(bad)}. Remove {'it' if len(bad) == 1 else 'them'} from the optimizer."
            )


def read_hyper(optimizer: torch.optim.Optimizer) -> list[AdamHyper]:
    decoupled_default = isinstance(optimizer, torch.optim.AdamW)
    out = []
    for g in optimizer.param_groups:
        beta1, beta2 = (float(b) for b in g["betas"])
        decoupled = decoupled_default or bool(g.get("decoupled_weight_decay", False))
        out.append(AdamHyper(float(g["lr"]), beta1, beta2, float(g["eps"]), float(g["weight_decay"]), decoupled))
    return out


class GradSource(Protocol):
    """Where one unit's reduced gradient for this rank's shard comes from."""

    def get(self) -> np.ndarray:
        """Block until the gradient is on the host; 1-D (reduced shard) or 2-D (R rows to sum)."""

    def release(self) -> None:
        """Called once the update has read the gradient."""


class UpdateAction(enum.Enum):
    """What the update lane does with one chunk (see :class:`UpdateTask`)."""

    UPDATE = "update"
    ACCUMULATE = "accumulate"
    ACCUMULATE_UPDATE = "accumulate_update"
    UPDATE_FROM_ACC = "update_from_acc"


@dataclass
class UpdateTask:
    """One chunk of one unit for the update lane.

    ``UPDATE``: apply ``grad``. ``ACCUMULATE``: add ``grad`` (times ``grad_scale``) into this rank's FP32
    accumulator (``first``: overwrite). ``ACCUMULATE_UPDATE``: accumulate, then apply the accumulator.
    ``UPDATE_FROM_ACC`` (``grad`` None): apply the accumulator times ``grad_scale``, after clamping it to
    ``[-clamp, clamp]`` when ``clamp`` is set."""

    unit: int
    step: int  # the Adam step t, 1-based
    hyper: list[AdamHyper]
    grad: GradSource | None
    lo: int  # the chunk: [lo, hi) of this rank's range of the unit
    hi: int
    last: bool  # the unit's last chunk: its version stamp moves after this one
    chunk: int
    grad_scale: float = 1.0
    action: UpdateAction = UpdateAction.UPDATE
    first: bool = False
    clamp: float | None = None


@dataclass
class _Call:
    fn: Callable[[], object]
    future: Future[Any]


class _AdamKwargs(TypedDict):
    """The keyword arguments of :func:`cpu_ops.adamw_update` and :func:`cpu_ops.adamw_update_sum`."""

    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    grad_scale: float
    bf16_out: np.ndarray | None


class UpdateLane:
    """One worker thread per rank running the fused Numba AdamW on the ledger, FIFO by unit."""

    def __init__(
        self,
        *,
        ledger: HostLedger,
        layout: Layout,
        topology: Topology,
        threads: int,
        tracer: Tracer | None = None,
    ) -> None:
        self.ledger = ledger
        self.layout = layout
        self.owner = owner = topology.owner_rank  # whose shard of each unit this lane updates and stamps
        self.threads = threads
        self.tracer = tracer or Tracer(None, topology.global_rank)
        self.segments: list[list[tuple[int, int, int]]] = []
        # per unit: its ranges of every region (numpy views; None where it has none: a wholly frozen unit's moments,
        # the int8 scales under fp32, the BF16 copy when it is not kept)
        self._arrays = [dict((r, ledger.region_np(r, u.index)) for r in ALL_REGIONS) for u in layout.units]
        self.int8 = ledger.geometry.optimizer_state == "int8"
        # regions on disk (ledger.disk): this rank's records of a unit's shard (at most 64 MiB each) are acquired as
        # the update reaches them and written back as it passes them, the next two read ahead meanwhile
        self._records = None
        if ledger.disk is not None:  # its I/O traced on the "disk" lane, in the step the update lane is in
            self._records = ledger.disk.stream(owner, on_io=self._trace_io if self.tracer.enabled else None)
        self._held: dict[tuple[int, int], dict[str, np.ndarray]] = {}  # (unit, piece) -> its record's views
        self._order: list[tuple[int, int]] = []  # records in the order this step acquired them
        self._last_order: list[tuple[int, int]] = []  # ... and the previous step's
        self._records_step = 0
        self._written_lock = threading.Lock()
        self._queue: queue.Queue[UpdateTask | _Call | None] = queue.Queue()
        self._idle = threading.Condition()
        self._outstanding = 0
        self._units_in_flight = 0  # units whose last chunk is queued or running
        self.error: BaseException | None = None
        self._sum_rows = (topology.shard_world,)  # host_reduce: the rows each update sums
        self._ready = threading.Event()
        self.jit_s = 0.0
        # this rank's FP32 gradient accumulator (accumulation, deferred updates), allocated on first use
        self._acc: np.ndarray | None = None
        self._acc_offset: list[int] = []
        total = 0
        for unit in layout.units:
            self._acc_offset.append(total)
            s0, s1 = unit.shard(owner)
            total += s1 - s0
        self._acc_total = total
        self._thread = threading.Thread(target=self._run, name=f"slidedp-update-r{topology.global_rank}", daemon=True)
        self._thread.start()

    def set_groups(self, group_of_slot: list[list[int]]) -> None:
        """Precompute, per unit, this rank's shard split into ranges of one param group each (group -1: frozen
        parameters, never updated)."""
        self.segments = []
        for unit, groups in zip(self.layout.units, group_of_slot):
            s0, s1 = unit.shard(self.owner)
            # every element up to the next parameter (alignment gaps, tail padding) joins the previous group
            bounds = [(0 if i == 0 else slot.offset, g) for i, (slot, g) in enumerate(zip(unit.slots, groups))]
            ranges: list[tuple[int, int, int]] = []
            for i, (start, g) in enumerate(bounds):
                end = bounds[i + 1][0] if i + 1 < len(bounds) else unit.padded
                a, b = max(start, s0), min(end, s1)
                if a < b:
                    if ranges and ranges[-1][2] == g and ranges[-1][1] == a:
                        ranges[-1] = (ranges[-1][0], b, g)
                    else:
                        ranges.append((a, b, g))
            self.segments.append(ranges)

    def accumulator(self) -> np.ndarray:
        """This rank's FP32 accumulator over all its shards (zero-length views until first used)."""
        if self._acc is None:
            self._acc = np.zeros(self._acc_total, np.float32)
        return self._acc

    def call(self, fn: Callable[[], object]) -> Future[Any]:
        """Run ``fn()`` on the lane thread after the tasks queued before it (kernels must run there)."""
        future: Future[Any] = Future()
        self.submit(_Call(fn, future))
        return future

    def submit(self, task: UpdateTask | _Call) -> None:
        self.raise_if_failed()
        with self._idle:
            self._outstanding += 1
            if getattr(task, "last", False):
                self._units_in_flight += 1
        self._queue.put(task)

    @property
    def units_in_flight(self) -> int:
        """Units whose last chunk is queued or running."""
        return self._units_in_flight

    def wait_units_below(self, limit: int, liveness=None) -> None:
        """Block while ``limit`` or more units' gradients wait for (or are in) the update: backpressure that
        bounds the gradient memory held for the update lane, however far it falls behind backward."""
        with self._idle:
            while self._units_in_flight >= limit and self.error is None:
                self._idle.wait(0.05)
                if liveness is not None:
                    liveness.check("the CPU update to catch up", float("inf"))
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError("the SlideDP CPU update failed") from self.error

    def wait_idle(self, liveness=None) -> None:
        """Block until every submitted update has finished."""
        with self._idle:
            while self._outstanding and self.error is None:
                self._idle.wait(0.05)
                if liveness is not None:
                    liveness.check("the CPU updates of this rank", float("inf"))
        self.raise_if_failed()

    def wait_ready(self) -> float:
        """Block until the worker compiled (or loaded) every kernel signature; returns the seconds it took."""
        self._ready.wait()
        self.raise_if_failed()
        return self.jit_s

    def _run(self) -> None:
        try:
            set_kernel_threads(self.threads)
            # here, never inside the first training step (with int8 moments: the 8-bit kernels too)
            self.jit_s = warmup(sum_rows=self._sum_rows, adam8=self.int8)
            if self._records is not None:
                assert self.ledger.disk is not None
                self.ledger.disk.clear(self.owner)  # zero moments in this rank's records
        except BaseException as exc:  # reported to the training thread
            self.error = exc
        finally:
            self._ready.set()
        while True:
            task = self._queue.get()
            if task is None:
                return
            try:
                if isinstance(task, _Call):
                    if task.future.set_running_or_notify_cancel():
                        try:
                            task.future.set_result(task.fn())
                        except BaseException as exc:
                            task.future.set_exception(exc)
                elif self.error is None:
                    self._apply(task)
            except BaseException as exc:  # reported to the training thread
                if isinstance(task, _Call):
                    log.error("SlideDP update-lane call %r failed: %s", task.fn, exc)
                else:
                    log.error("SlideDP update of unit %s failed: %s", task.unit, exc)
                self.error = exc
            finally:
                with self._idle:
                    self._outstanding -= 1
                    if getattr(task, "last", False):
                        self._units_in_flight -= 1
                    self._idle.notify_all()
            task = None  # the gradient it held goes now, not when the next task arrives

    def _apply(self, task: UpdateTask) -> None:
        unit = self.layout.units[task.unit]
        s0 = unit.shard(self.owner)[0]
        scale = task.grad_scale
        if task.action is UpdateAction.UPDATE:
            assert task.grad is not None, "an update task carries its gradient"
            grad = task.grad.get()
        else:
            off = self._acc_offset[task.unit]
            acc = self.accumulator()[off + task.lo : off + task.hi]
            if task.action is UpdateAction.UPDATE_FROM_ACC:
                if task.clamp is not None:
                    np.clip(acc, -task.clamp, task.clamp, out=acc)
            else:
                assert task.grad is not None, f"an {task.action.value} task carries its gradient"
                grad = task.grad.get()
                lane_delay()
                with self.tracer.span("update", "accumulate", task.step - 1, task.unit, task.chunk):
                    accumulate(acc, grad, grad_scale=scale, first=task.first)
                task.grad.release()
                if task.action is UpdateAction.ACCUMULATE:
                    return
                scale = 1.0
            grad = acc
        lane_delay()
        self._kernels(task, unit, grad, s0 + task.lo, s0 + task.hi, scale)
        lane_delay()
        if task.grad is not None and task.action is UpdateAction.UPDATE:
            task.grad.release()
        if task.last:
            if self._records is not None:
                self._release_unit(task.unit)  # a record the update did not reach to its end (frozen elements)
                self._records.when_written(task.unit, lambda: self._stamp_written(task.unit, task.step))
            else:
                self.ledger.written[task.unit, self.owner] = task.step
            self.ledger.version[task.unit, self.owner] = task.step

    # -- the shard records of the regions on disk (update-lane thread only) --------------------------------
    def _stamp_written(self, unit: int, step: int) -> None:
        """The state file holds ``unit``'s records of update ``step`` (on the I/O thread that wrote the last)."""
        with self._written_lock:  # two steps' writes of a unit may end on two I/O threads
            written = self.ledger.written
            written[unit, self.owner] = max(int(written[unit, self.owner]), step)

    def _trace_io(self, op: str, unit: int, start: float, end: float, nbytes: int) -> None:
        if self._records_step > 0:  # not the setup's clearing pass
            self.tracer.record("disk", op, self._records_step - 1, start, end, unit, nbytes=nbytes)

    def _record_state(self, task: UpdateTask, piece: int, rec: Record) -> dict[str, tuple[np.ndarray | None, int]]:
        """The unit's arrays for the elements of one of its records, each with the unit-relative element its index
        0 stands for: its ranges of the regions in memory (0) and the record's views of the regions on disk (the
        record's first element), acquired here when the update first reaches it."""
        assert self._records is not None
        out: dict[str, tuple[np.ndarray | None, int]] = {r: (a, 0) for r, a in self._arrays[task.unit].items()}
        key = (task.unit, piece)
        views = self._held.get(key)
        if views is None:
            if task.step != self._records_step:  # a new step: the last one's order guides the reads ahead
                self._records.check()
                self._last_order, self._order, self._records_step = self._order or self._last_order, [], task.step
            views = self._held[key] = self._records.acquire(*key)
            self._order.append(key)
            for ahead in self._next_records(key):
                self._records.prefetch(*ahead)
        out.update({r: (a, rec.start) for r, a in views.items()})
        return out

    def _next_records(self, key: tuple[int, int], ahead: int = 2) -> list[tuple[int, int]]:
        """The records to read ahead of ``key``'s update: those after it in the previous step's order (the first
        step: the unit's next pieces, then backward's order), going round to the next step's first at the end."""
        order = self._last_order
        if key not in order:
            order = [(u, p) for u in reversed(range(len(self.layout.units))) for p in range(len(self._pieces(u)))]
        i = order.index(key)
        return [order[(i + k) % len(order)] for k in range(1, min(ahead, len(order) - 1) + 1)]

    def _pieces(self, unit: int) -> list[Record]:
        """This rank's records of ``unit`` (state on disk)."""
        assert self._records is not None
        return self._records.layout.pieces(unit, self.owner)

    def _release(self, key: tuple[int, int]) -> None:
        del self._held[key]
        assert self._records is not None
        self._records.release(*key)

    def _release_unit(self, unit: int) -> None:
        for key in [k for k in self._held if k[0] == unit]:
            self._release(key)

    def flush_state(self, liveness=None) -> None:
        """After the updates submitted so far: every record written back (the state file holds them all) and none
        kept read ahead (the file may be written through its mapping next)."""
        if self._records is not None:
            self.call(self._flush_records)
            self.wait_idle(liveness)

    def _flush_records(self) -> None:
        assert self._records is not None
        for key in list(self._held):
            self._release(key)
        self._records.flush()
        self._records.drop_reads()

    def _kernels(self, task: UpdateTask, unit: Unit, grad: np.ndarray, c0: int, c1: int, scale: float) -> None:
        """Update unit-relative [c0, c1) from ``grad`` (its element 0 is c0): in memory at once; with state on
        disk record by record, each written back as soon as the update has passed its last element."""
        if not any(g >= 0 and sa < c1 and sb > c0 for sa, sb, g in self.segments[task.unit]):
            return  # frozen parameters only: their weights and moments stay bit-identical
        args = (task.step - 1, task.unit, task.chunk)
        if self._records is None:
            with self.tracer.span("update", "adamw", *args):
                self._update_range(task, {r: (a, 0) for r, a in self._arrays[task.unit].items()}, grad, c0, c1, scale)
            return
        for piece, rec in enumerate(self._pieces(task.unit)):
            lo, hi = max(rec.start, c0), min(rec.start + rec.elems, c1)
            if lo >= hi or not rec.nbytes:
                continue
            arrays = self._record_state(task, piece, rec)  # may wait for its read: the disk lane's time, off the span
            with self.tracer.span("update", "adamw", *args):
                self._update_range(task, arrays, grad[..., lo - c0 : hi - c0], lo, hi, scale)
            if hi == rec.start + rec.elems:  # the record's last element: written back now
                self._release((task.unit, piece))

    def _update_range(self, task: UpdateTask, arrays: dict, grad: np.ndarray, c0: int, c1: int, scale: float) -> None:
        """The kernels on unit-relative [c0, c1), one param-group run at a time (int8: one fused call);
        ``arrays``: (array, the unit-relative element of its index 0) per region."""
        if self.int8:
            self._kernels8(task, arrays, grad, c0, c1, scale)
            return

        def part(name: str, lo: int, hi: int) -> np.ndarray | None:
            array, base = arrays[name]
            return None if array is None else array[lo - base : hi - base]

        for sa, sb, g in self.segments[task.unit]:
            a, b = max(sa, c0), min(sb, c1)
            if a >= b or g < 0:  # g < 0: frozen parameters keep their weights and moments bit-identical
                continue
            master, exp_avg, exp_avg_sq, bf16 = (part(r, a, b) for r in ("master", "exp_avg", "exp_avg_sq", "bf16"))
            assert master is not None and exp_avg is not None and exp_avg_sq is not None
            h = task.hyper[g]
            kw = _AdamKwargs(
                step=task.step,
                lr=h.lr,
                beta1=h.beta1,
                beta2=h.beta2,
                eps=h.eps,
                weight_decay=h.weight_decay,
                decoupled=h.decoupled,
                grad_scale=scale,
                bf16_out=bf16,
            )
            if grad.ndim == 1:
                adamw_update(master, exp_avg, exp_avg_sq, grad[a - c0 : b - c0], **kw)
            else:
                adamw_update_sum(master, exp_avg, exp_avg_sq, grad[:, a - c0 : b - c0], **kw)

    def _kernels8(self, task: UpdateTask, arrays: dict, grad: np.ndarray, c0: int, c1: int, scale: float) -> None:
        """int8 moments: one fused call over unit-relative [c0, c1) (c0 on a QUANT_BLOCK boundary) with its
        param-group runs as segments; frozen runs are left out (their weights stay, their zero moments too), and so
        is a frozen tail that keeps no moments (``Unit.trainable_extent``). ``arrays``: (array, the unit-relative
        element of its index 0) per region (see :meth:`_record_state`)."""
        codes, base = arrays["exp_avg"]
        covered = base + codes.shape[0] if codes is not None else 0
        if c1 > covered:
            grad, c1 = grad[..., : max(covered - c0, 0)], max(covered, c0)
        segments = [
            (max(sa, c0) - c0, min(sb, c1) - c0, g)
            for sa, sb, g in self.segments[task.unit]
            if g >= 0 and sa < c1 and sb > c0
        ]
        if not segments:
            return
        if c0 % QUANT_BLOCK:
            raise AssertionError(f"int8 update chunk starts at {c0}, not on a {QUANT_BLOCK}-element block")

        def part(name: str) -> np.ndarray:
            array, base = arrays[name]
            if array is None:
                return None  # type: ignore[return-value]  # (the BF16 copy, when not kept)
            if name.endswith("_absmax"):  # one scale per block (bases are shard or record starts: block multiples)
                return array[(c0 - base) // QUANT_BLOCK : -(-(c1 - base) // QUANT_BLOCK)]
            return array[c0 - base : c1 - base]

        adamw8_update(
            part("master"),
            part("exp_avg"),
            part("exp_avg_sq"),
            part("exp_avg_absmax"),
            part("exp_avg_sq_absmax"),
            grad,
            segments=np.asarray(segments, dtype=np.int64),
            hyper=[(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.decoupled) for h in task.hyper],
            step=task.step,
            grad_scale=scale,
            bf16_out=part("bf16"),
        )

    def close(self, wait_s: float = 30.0) -> None:
        """Stop the worker after the queued updates (a daemon thread: a worker stuck on a dead peer is abandoned)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=wait_s)
        self._held.clear()  # the record stream itself is closed with the ledger's disk state
