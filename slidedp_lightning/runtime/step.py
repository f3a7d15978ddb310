"""One training step: the hooks that stream units and collect gradients, and the step boundary.

:class:`StepDriver` installs the module and parameter hooks (arXiv 2609.34162, §3; ``docs/step.md``,
"One step"): a forward pre-hook acquires a module's units, a forward hook releases them and registers an
output-gradient hook that acquires them again for backward; each parameter's post-accumulate-grad hook
collects its gradient and, once a unit is complete, dispatches it on the gradient route and queues its update
on the CPU lane. :meth:`StepDriver.end_step` closes the optimizer step (deferred updates, clipping, skipped
non-finite steps).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

import cpu_ops
from slidedp_lightning.models import UnsupportedModelError
from slidedp_lightning.runtime.compat import queue_backward_callback
from slidedp_lightning.runtime.config import EngineConfig
from slidedp_lightning.runtime.host_os import trim_host_heap
from slidedp_lightning.runtime.lanes.activations import ActivationManager
from slidedp_lightning.runtime.lanes.grad_route import GradRoute
from slidedp_lightning.runtime.lanes.liveness import Liveness, lane_delay
from slidedp_lightning.runtime.lanes.residency import UnitResidency
from slidedp_lightning.runtime.lanes.streams import Lanes
from slidedp_lightning.runtime.lanes.update import AdamHyper, UpdateAction, UpdateLane, UpdateTask, read_hyper
from slidedp_lightning.runtime.layout import Layout
from slidedp_lightning.runtime.topology import Topology
from slidedp_lightning.runtime.trace import Tracer

log = logging.getLogger(__name__)


class StepDriver:
    """The hooks of one rank's model and the optimizer-step boundary."""

    def __init__(
        self,
        *,
        model: nn.Module,
        layout: Layout,
        config: EngineConfig,
        topology: Topology,
        residency: UnitResidency,
        activations: ActivationManager,
        routes: GradRoute,
        lane: UpdateLane,
        lanes: Lanes,
        tracer: Tracer,
        liveness: Liveness,
    ) -> None:
        self.layout, self.config, self.topology = layout, config, topology
        self.residency, self.activations, self.routes, self.lane = residency, activations, routes, lane
        self.lanes, self.tracer, self.liveness = lanes, tracer, liveness
        self.step = 0  # optimizer steps whose updates have all been dispatched
        self.skipped = False  # the last end_step skipped a step with a non-finite gradient
        self.last_grad_norm: float | None = None  # deferred mode: the last step's global gradient norm
        self.optimizer: torch.optim.Optimizer | None = None
        self.slot_of: dict[int, tuple[int, int]] = {}  # id(parameter) -> (unit, slot)
        # tracing: (host seconds, name or None, step) since the compute thread left the units, see _leave
        self._outside: tuple[float, str | None, int] | None = None
        self._handles: list[RemovableHandle] = [
            model.register_forward_pre_hook(self._begin_forward),
            model.register_forward_hook(self._end_forward, always_call=True),
        ]
        self._check: ResidencyCheck | None = None  # the first training forward: no parameter read off the device
        self._checked = False
        for module, units in layout.compute_modules:
            self._handles.append(module.register_forward_pre_hook(self._pre_forward_hook(units)))
            self._handles.append(module.register_forward_hook(self._post_forward_hook(units)))
        for module, units in layout.borrowers:
            self._handles.append(module.register_forward_pre_hook(self._borrow_hook(units)))
            self._handles.append(module.register_forward_hook(self._return_hook(units), always_call=True))
        for ui, unit in enumerate(layout.units):
            for si, slot in enumerate(unit.slots):
                p = residency.param(ui, si)
                self.slot_of[id(p)] = (ui, si)
                if not slot.trainable:  # frozen: backward never waits for its gradient
                    continue
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._reset_step()

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- per backward pass and per step -------------------------------------------------------------------
    def _reset_backward(self) -> None:
        self._grads: list[list[torch.Tensor | None]] = [[None] * len(u.slots) for u in self.layout.units]
        self._pending = [u.trainable_slots for u in self.layout.units]
        self._callback_queued = False
        # units with frozen parameters held for backward: their last gradient does not mean their modules'
        # backward is done (a frozen norm still computes its input gradient from its weight), so each is
        # released when backward reaches an earlier unit (its input gradient is done) or when the pass ends
        self._frozen_held: list[int] = []

    def _reset_step(self) -> None:
        self._reset_backward()
        self._micro = 0  # backward passes completed in this optimizer step
        self._any_grad = False
        self._hyper: list[AdamHyper] | None = None
        self._step_t0: float | None = None  # tracing: the step's first training forward
        self._mark: Any = None  # tracing: when the compute lane last resumed compute (see Lanes.stamp)

    def _stamp(self, at: float | None = None) -> Any:
        """Tracing: a timestamp on the compute lane (None when tracing is off). ``at``: the host time that ends the
        compute thread's span before, taken just now: the timestamp when the compute lane runs on the host clock, so
        that the two spans meet (no gap for a preemption or a garbage collection to fall into unattributed)."""
        if not self.tracer.enabled:
            return None
        return at if at is not None and not self.lanes.is_stream("compute") else self.lanes.stamp("compute")

    def _compute_until_now(self, unit: int) -> float:
        """Tracing: the compute thread ran backward from the last mark until this hook; returns the host time of
        the span's end, where the hook's own span starts (0.0 when tracing is off)."""
        now = time.perf_counter() if self.tracer.enabled else 0.0
        if self.tracer.enabled and self._mark is not None:
            self.tracer.record("compute", "backward", self.step, self._mark, self._stamp(at=now), unit)
        return now

    # -- tracing: the compute thread outside the units ("loop" spans, docs/step.md "Lane traces") ------------
    def _leave(self, name: str | None = None, at: float | None = None) -> None:
        """The compute thread leaves the units (at host time ``at``, default now): the time until it is back becomes
        a ``loop`` span of this step, named ``name`` or, when None, by where it comes back."""
        if self.tracer.enabled:
            self._outside = (time.perf_counter() if at is None else at, name, self.step)

    def _back(self, name: str) -> float:
        """The compute thread is back in the units (returns the time): the span outside them, if one is open."""
        now = time.perf_counter()
        if self._outside is not None:
            start, phase, step = self._outside
            self.tracer.record("loop", phase or name, step, start, now)
            self._outside = None
        return now

    def trace_phase(self, done: str, then: str) -> None:
        """For the training loop, outside the units: the time outside them so far was ``done``, what follows until
        the compute thread is back in them is ``then`` (nothing when tracing is off or inside the units)."""
        if self._outside is not None:
            now = time.perf_counter()
            start, _, step = self._outside
            self.tracer.record("loop", done, step, start, now)
            self._outside = (now, then, step)

    # -- forward ------------------------------------------------------------------------------------------
    def _begin_forward(self, module: nn.Module, args: Any) -> None:
        self.residency.begin_forward()
        if not self._checked and torch.is_grad_enabled():
            self._checked = True
            self._check = ResidencyCheck(self.layout, self.slot_of, self.residency.resident)
            self._check.__enter__()

    def _end_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        check, self._check = self._check, None
        if check is not None:
            check.__exit__(None, None, None)

    def _pre_forward_hook(self, units: tuple[int, ...]) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            self.lane.raise_if_failed()
            lane_delay()
            tracing = self.tracer.enabled and torch.is_grad_enabled()
            if tracing and self._step_t0 is None:
                self._step_t0 = time.perf_counter()
                if self._outside is None:  # the first step: no loop span is open, and this acquire belongs to one
                    self._outside = (self._step_t0, None, self.step)
            self.residency.acquire(units, self.step, backward=False)
            back = self._back("model code between units") if tracing else None
            self._mark = self._stamp(at=back)

        return hook

    def _post_forward_hook(self, units: tuple[int, ...]) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.tracer.enabled and torch.is_grad_enabled():
                end = time.perf_counter()
                self.tracer.record("compute", "forward", self.step, self._mark, self._stamp(at=end), units[-1])
                self._mark = None  # loss, logging and the loop run outside the units: backward starts at its hook
                self._leave(at=end)
            self.residency.release(units)
            if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: self._on_output_grad(units))

        return hook

    def _borrow_hook(self, units: tuple[int, ...]) -> Callable:
        """A module outside every unit that reads ``units``' parameters through plain attributes: they are resident
        for its whole forward."""

        def hook(module: nn.Module, args: Any) -> None:
            self.residency.acquire(units, self.step, backward=False)

        return hook

    def _return_hook(self, units: tuple[int, ...]) -> Callable:
        """...and for backward from its outputs on (the first of them whose gradient arrives acquires them)."""

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.residency.release(units)
            if output is None or not torch.is_grad_enabled():  # None: its forward raised
                return
            if isinstance(output, torch.Tensor):
                outputs: Any = [output]
            else:  # a tuple or list, or a mapping such as transformers' ModelOutput
                outputs = output.values() if isinstance(output, Mapping) else output
            tensors = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
            first = [True]

            def on_grad(grad: torch.Tensor) -> None:
                if first[0]:
                    first[0] = False
                    self._on_output_grad(units)

            for t in tensors:
                t.register_hook(on_grad)

        return hook

    # -- backward -----------------------------------------------------------------------------------------
    def _on_output_grad(self, units: tuple[int, ...]) -> None:
        if self._micro >= self.config.accumulate:
            raise RuntimeError(
                f"SlideDP received a second gradient for this optimizer step: backward pass {self._micro + 1} with "
                f"accumulate={self.config.accumulate}. Close each step (optimizer_step / end_step) after "
                f"{self.config.accumulate} backward pass(es), or raise accumulate_grad_batches."
            )
        unit_of = self.layout.units
        done = [
            unit_of[u].name
            for u in units
            if self._pending[u] == 0 and not unit_of[u].frozen and u not in self._frozen_held
        ]
        if done:
            # the unit's gradient already went to the update lane and its device buffer is gone: stop before
            # autograd reads it
            raise RuntimeError(
                f"SlideDP: one backward pass reached unit(s) {done} a second time, after their gradient was "
                "reduced and handed to the CPU update (a module called twice in one forward, or retain_graph "
                "backward passes); each unit takes part in a forward pass once."
            )
        hook_t0 = self._compute_until_now(units[-1])
        self._release_frozen(keep=units)
        self.residency.acquire(units, self.step, backward=True)  # waiting here is traced as a stall
        self._frozen_held += [u for u in units if unit_of[u].has_frozen and u not in self._frozen_held]
        for u in units:
            self.activations.prefetch(u)
        end = None
        if self._outside is not None:
            end = self._back("loss, training step, backward to the first unit")
        elif self.tracer.enabled:
            end = time.perf_counter()
            self.tracer.record("loop", "hook: acquire for backward", self.step, hook_t0, end, units[-1])
        self._mark = self._stamp(at=end)

    def _release_frozen(self, keep: tuple[int, ...] = ()) -> None:
        """Release the units with frozen parameters held for backward, except ``keep``."""
        for u in [u for u in self._frozen_held if u not in keep]:
            self._frozen_held.remove(u)
            self.residency.release_backward(u)

    def _on_grad(self, param: torch.Tensor) -> None:
        ui, si = self.slot_of[id(param)]
        grad, param.grad = param.grad, None
        if self._grads[ui][si] is not None or self._pending[ui] == 0:
            raise RuntimeError(
                f"SlideDP received a second gradient for {self.layout.units[ui].slots[si].name} in one backward "
                "pass; each parameter takes part in a forward pass once."
            )
        if not self._callback_queued:
            queue_backward_callback(self._check_backward_complete)
            self._callback_queued = True
        self._any_grad = True
        self._grads[ui][si] = grad
        self._pending[ui] -= 1
        if self._pending[ui] == 0:
            self._unit_ready(ui)

    def _unit_ready(self, u: int) -> None:
        hook_t0 = self._compute_until_now(u)
        if u not in self._frozen_held:  # otherwise released by _release_frozen
            self.residency.release_backward(u)
        # complete: _pending[u] reached 0, so every slot holds the gradient its post-accumulate hook collected;
        # the list itself goes to dispatch(), which empties it to free the gradients early
        grads = cast(list[torch.Tensor], self._grads[u])
        self._grads[u] = [None] * len(grads)
        if self.optimizer is None:
            raise RuntimeError("SlideDP got gradients but no optimizer is attached; call attach_optimizer first.")
        if self._hyper is None:
            self._hyper = read_hyper(self.optimizer)
        if self.lane.units_in_flight >= self.config.max_units_in_flight:
            with self.tracer.span("stall", "wait update lane", self.step, u):
                self.lane.wait_units_below(self.config.max_units_in_flight, self.liveness)
        with self.tracer.span("reduce", "issue", self.step, u):
            chunks = self.routes.dispatch(u, grads, self.step)
        action = self._action()
        for k, (lo, hi, source) in enumerate(chunks):
            last = k == len(chunks) - 1
            task = UpdateTask(
                unit=u,
                step=self.step + 1,
                hyper=self._hyper,
                grad=source,
                lo=lo,
                hi=hi,
                last=last,
                chunk=k,
                grad_scale=self.routes.grad_scale,
                action=action,
                first=self._micro == 0,
            )
            self.lane.submit(task)
        end = None
        if self.tracer.enabled:  # the hook's own work around the stall and issue spans in it
            end = time.perf_counter()
            self.tracer.record("loop", "hook: dispatch gradient", self.step, hook_t0, end, u)
        self._mark = self._stamp(at=end)

    def _action(self) -> UpdateAction:
        """What the update lane does with the gradient of the backward pass now running."""
        if self.config.update == "deferred" or self._micro < self.config.accumulate - 1:
            return UpdateAction.ACCUMULATE
        return UpdateAction.ACCUMULATE_UPDATE if self._micro else UpdateAction.UPDATE

    def _check_backward_complete(self) -> None:
        end = self._compute_until_now(0)
        self._mark = None
        self._leave("after backward: the training loop", at=end)
        self._callback_queued = False
        self._release_frozen()
        missing = [
            s.name
            for ui, u in enumerate(self.layout.units)
            if self._pending[ui]
            for s, g in zip(u.slots, self._grads[ui])
            if g is None and s.trainable
        ]
        if missing:
            raise RuntimeError(
                f"{len(missing)} parameters received no gradient in this backward pass (e.g. {missing[:3]}). "
                "SlideDP updates each unit once per step and needs every parameter to take part in the loss."
            )
        self._micro += 1
        self._reset_backward()

    # -- the step boundary --------------------------------------------------------------------------------
    def end_step(
        self, clip_norm: float | None = None, clip_value: float | None = None, grad_scale: float = 1.0
    ) -> bool:
        """Close the optimizer step: True when it produced updates (all of them are now dispatched).

        Deferred mode (or an accumulation window that ended early): the accumulated gradient is applied here,
        multiplied by ``grad_scale`` (e.g. 1 / loss scale) and clipped to the global norm ``clip_norm`` or to
        ``[-clip_value, clip_value]``; a non-finite gradient on any rank skips the step on every rank (False).
        """
        self.lane.raise_if_failed()
        self.skipped = False
        if not self._any_grad:
            return False
        if self._callback_queued:  # a backward pass whose completion check has not run
            self._check_backward_complete()
        closed, window_end = self.step, None
        if self.tracer.enabled:
            window_end = self._back("after backward: the training loop")
            self.tracer.mark_step(self.step, self._step_t0 or window_end, window_end)
        self.activations.end_step()
        applied = True
        if self.config.update == "deferred" or self._micro < self.config.accumulate:
            applied = self._apply_accumulated(clip_norm, clip_value, grad_scale)
        elif clip_norm or clip_value or grad_scale != 1.0:
            raise RuntimeError(
                "clipping and gradient scaling need update='deferred' (the engine was built with update='immediate')"
            )
        if applied:
            self._stamp_frozen()
            self.step += 1
            if self.step == 1:  # the first step's one-off allocations (JIT, warm-up) are done
                trim_host_heap()
        self._reset_step()
        if window_end is not None:
            now = time.perf_counter()
            self.tracer.record("loop", "close the step", closed, window_end, now)
            self._outside = (now, "training loop between steps", closed)
        return applied

    def _stamp_frozen(self) -> None:
        """Wholly frozen units get no update: stamp this rank's shard of each as current for the next step, after
        the updates queued before (readers of the stamps wait for every unit)."""
        frozen = [u for u, unit in enumerate(self.layout.units) if unit.frozen]
        if frozen:
            ledger, owner, step = self.lane.ledger, self.lane.owner, self.step + 1

            def stamp() -> None:
                ledger.version[frozen, owner] = ledger.written[frozen, owner] = step

            self.lane.call(stamp)

    def _global_norm(self, grad_scale: float) -> float:
        """The exact global norm of the accumulated gradient (float64 sum of squares of every rank's shards)."""
        squares = self.lane.call(lambda: cpu_ops.sum_squares(self.lane.accumulator())).result()
        total = torch.tensor([squares], dtype=torch.float64)
        group = self.topology.shard_group
        if group is not None and not self.topology.ledger_per_rank:  # shards are disjoint: the norm sums them
            dist.all_reduce(total, group=group)
        elif group is not None:  # every rank holds the whole gradient: agree on non-finite values
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return float(total.sqrt()) * abs(grad_scale)

    def _apply_accumulated(self, clip_norm: float | None, clip_value: float | None, grad_scale: float) -> bool:
        """Check, clip and apply this rank's accumulated shards (forward order: the next step needs unit 0 first)."""
        assert self.optimizer is not None
        if self._hyper is None:
            self._hyper = read_hyper(self.optimizer)
        self.lane.wait_idle(self.liveness)
        norm = self.last_grad_norm = self._global_norm(grad_scale)
        if not math.isfinite(norm):
            log.warning(
                "SlideDP: non-finite gradient (global norm %s) in step %d: the step is skipped on every rank, "
                "weights and moments untouched.",
                norm,
                self.step,
            )
            self.skipped = True
            return False
        scale = grad_scale
        if clip_norm:
            scale *= min(1.0, clip_norm / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s coefficient
        clamp = clip_value / abs(grad_scale) if clip_value else None  # in the accumulator's (scaled) units
        owner = self.topology.owner_rank
        for u, unit in enumerate(self.layout.units):
            if unit.frozen:  # no gradient, no update (stamped by end_step)
                continue
            s0, s1 = unit.shard(owner)
            chunks = self.routes.chunks(s1 - s0)
            for k, (lo, hi) in enumerate(chunks):
                task = UpdateTask(
                    unit=u,
                    step=self.step + 1,
                    hyper=self._hyper,
                    grad=None,
                    lo=lo,
                    hi=hi,
                    last=k == len(chunks) - 1,
                    chunk=k,
                    grad_scale=scale,
                    action=UpdateAction.UPDATE_FROM_ACC,
                    clamp=clamp,
                )
                self.lane.submit(task)
        return True


# tensor attributes and methods that read no data (a model's ``dtype``/``device`` properties read them from any
# parameter, resident or not)
METADATA = frozenset(
    {"__get__", "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset", "is_contiguous"}
    | {"element_size", "is_floating_point", "is_complex", "untyped_storage", "data_ptr", "get_device", "__len__"}
)


class ResidencyCheck(TorchFunctionMode):
    """During the first training forward: an operation reading a streamed parameter whose unit is not on the device
    (a tie or weight read that no module call shows, e.g. through a global) is refused by name, before the storage
    error it would otherwise raise deep inside the operator (or, on a CPU device computing on the ledger itself, the
    read that would otherwise succeed there and fail on a GPU). ``resident``: the residency's live flags per unit."""

    def __init__(self, layout: Layout, slot_of: dict[int, tuple[int, int]], resident: Sequence[bool]) -> None:
        super().__init__()
        self.layout, self.slot_of, self.resident = layout, slot_of, resident

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in METADATA:  # reads no data: fine for a unit that is not resident
            return func(*args, **kwargs)
        for arg in (*args, *kwargs.values()):
            if (
                isinstance(arg, nn.Parameter)
                and id(arg) in self.slot_of
                and not self.resident[self.slot_of[id(arg)][0]]
            ):
                ui, si = self.slot_of[id(arg)]
                unit = self.layout.units[ui]
                raise UnsupportedModelError(
                    f"SlideDP: {getattr(func, '__name__', func)} read parameter {unit.slots[si].name} while its unit "
                    f"'{unit.name}' was not on the device: the model reads it outside the calls of the modules that "
                    "own it, by a path SlideDP cannot see. Hold the module it belongs to as a registered submodule "
                    "(or the parameter as a plain attribute of the module that reads it: SlideDP follows those), or "
                    "describe the model's units with slidedp_lightning.models.register_adapter."
                )
        return func(*args, **kwargs)
