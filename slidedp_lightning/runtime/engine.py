"""The SlideDP engine: streams a model's units through the device and updates them on the CPU.

Device-agnostic and free of Lightning. One call builds everything a rank needs, in this order (each part is
closed in the reverse order by :meth:`SlideDPEngine.close`, or at once if a later part fails):

1. ``_plan_units``: the streamed model's units and flat layout, "auto" routes measured (``route_probe``);
2. ``_open_ledger``: the host ledger created, filled and mapped (``ledger/opening``; :class:`Topology` says by
   whom);
3. ``_start_lanes``, ``_bind_units``: the lanes; unit residency (device buffers bound to the model's parameters,
   the prefetch lane), per-block checkpointing and offload, the gradient route;
4. ``_start_update_lane``: the CPU update lane;
5. ``_install_step``: ``StepDriver`` (the hooks and the optimizer-step boundary) and ``LedgerState`` (named views
   for state dicts, checkpoints and export).
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import ExitStack
from dataclasses import replace
from functools import partial
from typing import Any, Literal, cast

import torch
from torch import nn

import cpu_ops
from slidedp_lightning import models
from slidedp_lightning.models import adapter_for
from slidedp_lightning.runtime.config import EngineConfig
from slidedp_lightning.runtime.host_os import format_bytes, trim_host_heap
from slidedp_lightning.runtime.lanes.activations import ActivationManager
from slidedp_lightning.runtime.lanes.grad_route import GradRoute
from slidedp_lightning.runtime.lanes.liveness import Liveness, peer_states, set_lane_delay, wait_until
from slidedp_lightning.runtime.lanes.residency import UnitResidency
from slidedp_lightning.runtime.lanes.streams import make_lanes
from slidedp_lightning.runtime.lanes.update import UpdateLane, validate_optimizer
from slidedp_lightning.runtime.layout import build_layout
from slidedp_lightning.runtime.ledger.geometry import LedgerStats
from slidedp_lightning.runtime.ledger.initial_weights import InitialWeights
from slidedp_lightning.runtime.ledger.opening import ledger_geometry, open_ledger
from slidedp_lightning.runtime.ledger.pages import lock_ranges
from slidedp_lightning.runtime.ledger.preflight import available_host_bytes
from slidedp_lightning.runtime.ledger.state import LedgerState, UnsupportedLayoutError
from slidedp_lightning.runtime.route_probe import resolve_auto_routes
from slidedp_lightning.runtime.step import StepDriver
from slidedp_lightning.runtime.topology import Topology
from slidedp_lightning.runtime.trace import Tracer

__all__ = ["EngineConfig", "SlideDPEngine", "UnsupportedLayoutError", "find_streamed_model"]

log = logging.getLogger(__name__)

ABORT_DRAIN_S = 10.0  # after an error: how long closing waits for the device copies still running


def find_streamed_model(root: nn.Module) -> nn.Module:
    """The module of ``root`` (itself included) that SlideDP streams (see :func:`models.find_streamed_model`); the
    error, when there is none, names ``root``'s class."""
    return models.find_streamed_model(root)


def check_stream_concurrency(device: torch.device, threads_issue_collectives: bool) -> None:
    """Refuse ``CUDA_DEVICE_MAX_CONNECTIONS=1`` when collectives of several groups are issued from several threads
    (the sharded route's all-gathers come from the H2D lane while backward reduce-scatters gradients): with one
    hardware queue every stream's kernels run in launch order, and two ranks that launched the same two
    collectives in a different order would each wait on a kernel queued behind the other's."""
    if device.type == "cuda" and threads_issue_collectives and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        raise ValueError(
            "SlideDP: CUDA_DEVICE_MAX_CONNECTIONS=1 serializes the CUDA streams, and the sharded param_route issues "
            "its all-gathers from another thread than the gradient collectives: ranks could deadlock. Unset "
            "CUDA_DEVICE_MAX_CONNECTIONS, or use param_route='full'."
        )


def _trainable_note(trainable: int, frozen: int, stats: LedgerStats | None = None) -> str:
    """The log line's parameter split and, with frozen parameters, what each part costs in the ledger."""
    if not frozen:
        return f"{trainable:,} trainable, 0 frozen"
    note = f"{trainable:,} trainable, {frozen:,} frozen"
    if stats is not None and stats.frozen_params:
        note += (
            f" (frozen: {stats.frozen_bytes_per_param:.2f} B/param, trainable: "
            f"{stats.trainable_bytes_per_param:.2f} B/param)"
        )
    return note


class SlideDPEngine:
    """Owns the ledger, the device buffers, the hooks and the lanes of one rank.

    ``planner``: called as ``planner(engine, unit, args, kwargs)`` at the first training forward of the first
    decoder block, returns the activation policy for every block (AutoPolicy).
    """

    def __init__(
        self,
        root: nn.Module,
        config: EngineConfig,
        *,
        device: torch.device,
        compute_dtype: torch.dtype,
        topology: Topology | None = None,
        planner: Any = None,
    ) -> None:
        t0 = time.perf_counter()
        torch_threads = torch.get_num_threads()
        cpu_ops.start_kernel_pool()  # not from this thread: it would take this thread's torch ops to every core
        self.root, self.device, self.compute_dtype = root, device, compute_dtype
        self.topology = topology or Topology()
        self._closed = self._aborted = False
        self._copies_done = True  # False: device copies were still running when the lanes closed
        self._restore: bool | str = "auto"
        specs = self._plan_units(config)
        weights = InitialWeights(self.model, self.adapter, self.layout, self.topology)
        with ExitStack() as stack:
            self._open_ledger(weights, stack)
            self._start_lanes(stack)
            self._bind_units(specs, planner, stack)
            threads = self._start_update_lane(stack)
            self._install_step(weights, stack)
            if torch.get_num_threads() != torch_threads:
                raise RuntimeError(
                    f"torch's thread count changed during SlideDP setup ({torch_threads} -> "
                    f"{torch.get_num_threads()}): the training thread would oversubscribe the host's cores"
                )
            self._teardown = stack.pop_all()
        self._log_setup(threads, time.perf_counter() - t0)

    # -- setup, in build order (each part registers its teardown on the ExitStack) ---------------------------
    def _plan_units(self, config: EngineConfig) -> list:
        """The streamed model, its adapter and units, the flat layout, and the config with "auto" resolved."""
        topology, device = self.topology, self.device
        self.model = model = find_streamed_model(self.root)
        self.adapter = adapter_for(model)
        specs = self.adapter.units(model)
        hidden = models.hidden_uses(model)
        self.layout = layout = build_layout(self.root, specs, topology.shard_world, topology.owners, hidden)
        self.config, self.route_probe = config, None
        if config.auto_routes:  # measured: the route probe (explicit routes are used as given)
            self.config, self.route_probe = resolve_auto_routes(config, topology, layout, device, self.compute_dtype)
        if self.config.h2d_convert == "auto":  # CUDA: half the link bytes; a CPU device: no link, no staging pass
            self.config = replace(self.config, h2d_convert="host" if device.type == "cuda" else "device")
        check_stream_concurrency(device, self._sharded_params)  # before any state: the route as configured
        self.adapter.materialize_buffers(model)
        return specs

    @property
    def _sharded_params(self) -> bool:
        return self.config.param_route == "sharded" and self.topology.shard_world > 1

    def _open_ledger(self, weights: InitialWeights, stack: ExitStack) -> None:
        """The host's ledger (collective), and the liveness of the ranks that map it."""
        self.geometry = ledger_geometry(self.layout, self.config, self.topology, self.compute_dtype)
        self.ledger = ledger = open_ledger(
            self.geometry, self.layout.num_params, weights, self.topology, self.config.state_dir
        )
        stack.callback(lambda: ledger.close(copies_done=self._copies_done))
        self.liveness = Liveness(  # the pids of the ranks that map this ledger, by rank, 0 for this one
            pids=lambda: [0 if p == os.getpid() else int(p) for p in ledger.pids],
            timeout_s=self.config.timeout_s,
            own_error=self._lane_error,
        )

    def _start_lanes(self, stack: ExitStack) -> None:
        """The tracer and the lanes every copy and collective is issued on."""
        self.tracer = Tracer(self.config.trace_dir, self.topology.global_rank)
        stack.callback(self.tracer.close)
        self.lanes = make_lanes(self.device, self.tracer)
        stack.callback(lambda: self._close_lanes())
        set_lane_delay(self.config.lane_delay_ms)
        if self.config.lane_delay_ms:
            log.warning("SlideDP fault injection: random delays up to %.1f ms in every lane", self.config.lane_delay_ms)

    def _bind_units(self, specs: list, planner: Any, stack: ExitStack) -> None:
        """Lanes 1, 2 and 4-5: unit residency (the parameters become views of device buffers), the activation
        policies on the decoder blocks, and the gradient route."""
        config = self.config
        self.residency = UnitResidency(
            layout=self.layout,
            ledger=self.ledger,
            lanes=self.lanes,
            liveness=self.liveness,
            topology=self.topology,
            dtype=self.compute_dtype,
            window=config.prefetch_window,
            sharded=self._sharded_params,
            h2d_convert="host" if config.h2d_convert == "host" else "device",
            copies=cast(Literal["auto", "always", "never"], config.unit_copies),
        )
        self.residency.bind()
        # close() resolves "auto" to a bool first; a construction failing midway still holds "auto" (truthy)
        stack.callback(lambda: self.residency.unbind(bool(self._restore)))
        stack.callback(self.residency.evict_all)
        self.activations = ActivationManager(
            blocks={i: spec.modules[0] for i, spec in enumerate(specs) if spec.block},
            names=[u.name for u in self.layout.units],
            policy=config.activation_policy,
            lanes=self.lanes,
            param_storages=self.residency.resident_storages,
            planner=partial(planner, self) if planner else None,
        )
        self.activations.install()
        stack.callback(self.activations.uninstall)
        self.routes = GradRoute(
            layout=self.layout,
            ledger=self.ledger,
            lanes=self.lanes,
            route="host_reduce" if config.grad_route == "host_reduce" else "gpu_reduce",
            liveness=self.liveness,
            topology=self.topology,
            chunk_elems=config.chunk_elems,
        )
        stack.callback(self.routes.close)
        if self.device.type == "cuda":  # before the first copy; ledger.close() unpins
            self.ledger.pin(lock_ranges(self.ledger, self.dma_views()))

    def _start_update_lane(self, stack: ExitStack) -> int:
        """Lane 6, the CPU update on this rank's shards; returns its thread count."""
        threads = cpu_ops.thread_budget(self.topology.ranks_per_host, self.config.update_threads)
        # Numba kernels run on the update lane thread only: its OpenMP runtime is torch's, and a kernel
        # launched on the training thread would change torch's thread count there (oversubscription)
        self.lane = UpdateLane(
            ledger=self.ledger, layout=self.layout, topology=self.topology, threads=threads, tracer=self.tracer
        )
        stack.callback(lambda: self.lane.close(wait_s=1.0 if self._aborted else 30.0))
        return threads

    def _install_step(self, weights: InitialWeights, stack: ExitStack) -> None:
        """The hooks and the step boundary, the named views of the ledger, and the kernels compiled."""
        self.steps = StepDriver(
            model=self.model,
            layout=self.layout,
            config=self.config,
            topology=self.topology,
            residency=self.residency,
            activations=self.activations,
            routes=self.routes,
            lane=self.lane,
            lanes=self.lanes,
            tracer=self.tracer,
            liveness=self.liveness,
        )
        stack.callback(self.steps.remove_hooks)
        self.state = LedgerState(
            self.root, self.layout, self.ledger, self.topology, self.steps.slot_of, weights.host_ranges()
        )
        self.lane.wait_ready()
        trim_host_heap()  # the model's original parameters are gone: return their memory to the OS

    def _log_setup(self, threads: int, seconds: float) -> None:
        layout, geometry, config = self.layout, self.geometry, self.config
        private = self.ledger.file.kind.startswith("private")  # one local rank: no other process maps it
        log.log(
            logging.INFO if self.topology.global_rank == 0 else logging.DEBUG,
            "SlideDP %s: %d units, %s params (%s), ledger %s in %s memory (%.2f B/param)%s, route %s/%s, "
            "window %d, %s %s (%d of %d units computed in the ledger, unit copies %s), %d update thread(s), "
            "%d torch thread(s), kernels ready in %.2f s, setup %.2f s",
            self.topology.describe(),
            len(layout.units),
            f"{layout.num_params:,}",
            _trainable_note(layout.num_trainable, layout.num_params - layout.num_trainable, self.ledger_stats()),
            format_bytes(geometry.nbytes),
            "private" if private else "shared",
            geometry.nbytes / layout.num_params,
            self._disk_note(),
            config.param_route,
            config.grad_route,
            config.prefetch_window,
            self.device,
            self.compute_dtype,
            sum(self.residency.aliased),
            len(layout.units),
            config.unit_copies,
            threads,
            torch.get_num_threads(),  # the training thread's (its forward and backward on a CPU device)
            self.lane.jit_s,
            seconds,
        )

    def _disk_note(self) -> str:
        disk = self.ledger.disk
        if disk is None:
            return ""
        io = "direct" if disk.state.direct else "buffered"
        return f", {'+'.join(disk.layout.regions)} in a {format_bytes(disk.state.nbytes)} state file in {disk.directory} ({io} I/O)"

    def _lane_error(self) -> BaseException | None:
        """A failure of this rank's own update or D2H lane (ends every wait on the other ranks at once)."""
        lane, routes = getattr(self, "lane", None), getattr(self, "routes", None)
        if lane is not None and lane.error is not None:
            return lane.error
        return routes.error if routes is not None else None

    def _close_lanes(self) -> None:
        self.lanes.close(wait=not self._aborted)
        # no copy may still read or write the ledger when it is unpinned and unmapped; after an error, a copy or
        # collective that does not end soon keeps the ledger mapped until the process exits
        self._copies_done = self.lanes.drain(timeout_s=ABORT_DRAIN_S if self._aborted else None)

    # -- the step -------------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Optimizer steps whose updates have all been dispatched."""
        return self.steps.step if self.steps is not None else self._final_step

    @step.setter
    def step(self, value: int) -> None:
        self.steps.step = value

    @property
    def skipped(self) -> bool:
        """The last :meth:`end_step` skipped a step with a non-finite gradient."""
        return self.steps.skipped

    @property
    def last_grad_norm(self) -> float | None:
        """Deferred updates: the global gradient norm of the last step."""
        return self.steps.last_grad_norm

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Validate the user's optimizer and map every trainable parameter to its param group (frozen ones, which
        the optimizer may leave out, get group -1: never updated)."""
        validate_optimizer(optimizer)
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        table, missing = [], []
        for unit in self.layout.units:
            row = []
            for slot in unit.slots:
                module, attr = slot.locations[0]
                gi = group_of.get(id(getattr(module, attr)))
                if not slot.trainable:
                    gi = -1
                elif gi is None:
                    missing.append(slot.name)
                row.append(gi if gi is not None else 0)
            table.append(row)
        if missing:
            raise ValueError(
                f"{len(missing)} trainable parameters are not in the optimizer (e.g. {missing[:3]}). SlideDP "
                "updates every trainable parameter it streams: pass all of them to the optimizer (e.g. "
                "[p for p in self.parameters() if p.requires_grad]), "
                "created in configure_optimizers (after the model is built)."
            )
        self.lane.set_groups(table)
        self.steps.optimizer = optimizer

    def end_step(
        self, clip_norm: float | None = None, clip_value: float | None = None, grad_scale: float = 1.0
    ) -> bool:
        """Close the optimizer step; see :meth:`StepDriver.end_step`."""
        return self.steps.end_step(clip_norm, clip_value, grad_scale)

    def trace_phase(self, done: str, then: str) -> None:
        """Tracing, for the training loop: the compute thread's time outside the units so far was ``done``, from
        now on it is ``then`` (``docs/step.md``, "Lane traces")."""
        if self.steps is not None:
            self.steps.trace_phase(done, then)

    def synchronize(self) -> None:
        """Wait until every rank's updates of every dispatched step are in the ledger (and in its state file on
        disk, when it has one: each rank's records written back, which follows its update stamp)."""
        self.lane.wait_idle(self.liveness)
        self.lane.flush_state(self.liveness)
        owners = self.topology.host_owners  # the owners whose shards this ledger holds
        version = self.ledger.version[:, owners]
        wait_until(lambda: bool((version >= self.step).all()), self.liveness, "all ranks' updates")
        if self.ledger.disk is not None:
            written = self.ledger.written[:, owners]
            wait_until(lambda: bool((written >= self.step).all()), self.liveness, "all ranks' state-file writes")

    # -- reports --------------------------------------------------------------------------------------
    def device_memory(self) -> dict[str, int]:
        """Device bytes the runtime accounts (on CPU too): resident unit parameters now and at peak, the
        activations the decoder blocks retained in the last finished step (on the device / offloaded) and, on a
        CPU device, the pooled flat gradient buffers."""
        pool = self.routes.pool
        return {
            "resident_param_bytes": self.residency.resident_bytes,
            "peak_resident_param_bytes": self.residency.peak_resident_bytes,
            "grad_buffer_bytes": pool.nbytes if pool is not None else 0,
            "retained_activation_bytes": self.activations.last_step.get("retained_bytes", 0),
            "offloaded_activation_bytes": self.activations.last_step.get("offloaded_bytes", 0),
        }

    def dma_views(self) -> list[torch.Tensor]:
        """The ledger memory this rank's device copies read or write: the fill sources and, under host_reduce,
        its staging row (what :meth:`HostLedger.pin` page-locks on CUDA, in :func:`~slidedp_lightning.runtime.ledger.pages.lock_ranges`)."""
        views = self.residency.dma_sources()
        if self.routes.route == "host_reduce" and self.ledger.staging is not None:
            views.append(self.ledger.staging[self.topology.shard_rank])
        return views

    def ledger_stats(self) -> LedgerStats:
        """The size of this host's ledger and the memory it holds now, split into the trainable parameters (with the
        units' trainable prefixes) and the frozen ones (with the rest)."""
        g = self.ledger.geometry
        trainable = self.layout.num_trainable
        return LedgerStats(
            nbytes=g.nbytes,
            num_params=self.layout.num_params,
            padded_params=self.layout.total,
            allocated_bytes=self.ledger.allocated_bytes(),
            copies=self.topology.ledger_copies,
            trainable_params=trainable,
            trainable_bytes=sum(g.unit_bytes(u.index, 0, u.trainable_extent) for u in self.layout.units),
            frozen_params=self.layout.num_params - trainable,
            frozen_bytes=sum(g.unit_bytes(u.index, u.trainable_extent) for u in self.layout.units),
        )

    # -- state (readers synchronize first; writers also evict every resident unit) ----------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The root module's state dict with FP32 master weights (copies), keyed as ``root.state_dict()``."""
        self.state.require_whole_parameters("state_dict")
        self.synchronize()
        return self.state.state_dict()

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """``optimizer.state_dict()`` as torch's Adam/AdamW would return it, with the moments from the ledger."""
        self.state.require_whole_parameters("optimizer_state_dict")
        self.synchronize()
        return self.state.optimizer_state_dict(optimizer, self.step)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Write weights (keyed as ``root.state_dict()``) into the FP32 master and its BF16 copy."""
        self.state.require_whole_parameters("load_state_dict")
        self.synchronize()
        self.drop_resident()
        self.state.load_state_dict(state_dict, strict)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Restore moments, step count and group hyper-parameters saved by :meth:`optimizer_state_dict`."""
        self.state.require_whole_parameters("load_optimizer_state_dict")
        self.synchronize()
        self.step = self.state.load_optimizer_state_dict(optimizer, state)

    def drop_resident(self) -> None:
        """Before the ledger's weights are rewritten: no fill may still read them, and no unit may stay resident
        with the old ones."""
        self.residency.evict_all()
        self.lanes.drain()

    def restored(self, step: int, buffers: dict[str, torch.Tensor]) -> None:
        """After every rank wrote its part of a checkpoint into the ledger: BF16 copy, step count, stamps."""
        self.state.restored(step, buffers)
        self.step = step

    # -- teardown -------------------------------------------------------------------------------------
    def peer_states(self) -> str:
        """The ranks of this host that cannot be making progress (dead, stopped), as a sentence; empty if none."""
        return peer_states(self.liveness.pids()) if self.liveness is not None else ""

    def abort(self) -> None:
        """After an error: stop waiting on other ranks; teardown will not synchronize."""
        self._aborted = True

    def _restore_fits(self) -> bool:
        """Whether FP32 copies of the model on every local rank fit comfortably in the host's free memory."""
        if self.topology.host_sharded:  # no host holds whole parameters
            log.warning("SlideDP: host-sharded ledgers: the module's parameters are left on the meta device.")
            return False
        need = self.layout.num_params * 4 * self.topology.ranks_per_host
        available = available_host_bytes()[0]
        if need < available // 2:
            return True
        log.warning(
            "SlideDP: not restoring the module's parameters after training (%d ranks x %s of FP32 copies "
            "would exceed half of the %s available); they are left on the meta device. Save a checkpoint "
            "(ModelCheckpoint) or export with SaveHuggingFace to keep the weights.",
            self.topology.ranks_per_host,
            format_bytes(self.layout.num_params * 4),
            format_bytes(available),
        )
        return False

    def close(self, restore: bool | str = "auto") -> None:
        """Stop the lanes, give the model ordinary parameters again and unmap the ledger.

        ``restore``: True = FP32 CPU copies of the master; False = meta tensors; "auto" = copies when they fit
        in half of the available host memory, else meta (with a warning). After close the engine holds no
        process group, thread or hook, so nothing of it keeps a collective backend alive.
        """
        if self._closed:
            return
        self._closed = True
        self._final_step = self.step
        self._restore = self._restore_fits() if restore == "auto" or self.topology.host_sharded else restore
        try:
            if self.lane.error is None and not self._aborted:
                self.synchronize()
        finally:
            self._teardown.close()
            # break every reference to process groups and to the parts that hold them (and their cycles through
            # hook closures): a closed engine may be collected late, and must not keep a backend's threads alive
            self.topology = self.topology.released()
            self.state.topology = self.topology
            for part in ("routes", "residency", "activations", "steps", "lanes", "liveness"):
                setattr(self, part, None)
