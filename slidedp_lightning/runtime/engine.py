"""The SlideDP engine: streams a model's units through the device and updates them on the CPU.

Device-agnostic and free of Lightning: it needs a model, a device, a compute dtype and (for R > 1) an
initialized ``torch.distributed`` process group whose ranks all run on this host.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field, replace
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

import cpu_ops
from slidedp_lightning.models import adapter_for, chunked_loss
from slidedp_lightning.models.adapter import UnsupportedModelError
from slidedp_lightning.runtime.activations import ActivationManager, ActivationPolicy
from slidedp_lightning.runtime.grads import GRAD_ROUTES, GradRoute
from slidedp_lightning.runtime.host_state import (
    HostLedger,
    LedgerGeometry,
    LedgerStats,
    available_host_bytes,
    check_host_memory,
    ledger_path,
    remove_stale_ledgers,
    trim_host_heap,
)
from slidedp_lightning.runtime.lanes import make_lanes
from slidedp_lightning.runtime.layout import Layout, build_layout
from slidedp_lightning.runtime.params import UnitResidency
from slidedp_lightning.runtime.probe import RouteProbe, probe_routes
from slidedp_lightning.runtime.sync import Liveness, lane_delay, set_lane_delay, wait_until
from slidedp_lightning.runtime.trace import Tracer
from slidedp_lightning.runtime.update import UpdateLane, UpdateTask, read_hyper, validate_optimizer

log = logging.getLogger(__name__)

PARAM_ROUTES = ("full", "sharded", "replicated")
UPDATE_MODES = ("immediate", "deferred")


@dataclass(frozen=True)
class EngineConfig:
    """What the user chooses; everything else is derived."""

    grad_route: str = "gpu_reduce"
    param_route: str = "full"
    prefetch_window: int = 2
    update_threads: int | None = None
    staging_slots: int = 2
    timeout_s: float = 1800.0
    trace_dir: str | None = None
    chunk_bytes: int | str | None = None  # gradient path: FP32 bytes per reduce + update chunk; None = one per unit
    activation_policy: ActivationPolicy = ActivationPolicy()  # per decoder block: checkpointing + offload ratio
    # "immediate": a unit is updated as soon as its (last micro-batch's) gradient lands; "deferred": gradients
    # are accumulated until the step ends, then checked (non-finite: the step is skipped), clipped and applied
    update: str = "immediate"
    accumulate: int = 1  # backward passes (micro-batches) per optimizer step
    loss_chunk_tokens: int | None = None  # causal-LM loss in chunks of this many tokens (no full logits)
    max_units_in_flight: int = 2  # units whose gradient may wait for the CPU update before backward waits
    # test-only fault injection (see sync.lane_delay); read from SLIDEDP_TEST_LANE_DELAY_MS
    lane_delay_ms: float = field(default_factory=lambda: float(os.environ.get("SLIDEDP_TEST_LANE_DELAY_MS", "0")))

    def __post_init__(self) -> None:
        if self.grad_route not in GRAD_ROUTES + ("auto",):
            raise ValueError(f"grad_route must be one of {GRAD_ROUTES + ('auto',)}, got {self.grad_route!r}.")
        if self.param_route not in PARAM_ROUTES + ("auto",):
            raise ValueError(f"param_route must be one of {PARAM_ROUTES + ('auto',)}, got {self.param_route!r}.")
        if self.param_route == "replicated" and self.grad_route not in ("gpu_reduce", "auto"):
            raise ValueError(
                "param_route='replicated' (every rank keeps and updates its own ledger) reduces gradients with an "
                f"all-reduce on the devices; grad_route={self.grad_route!r} does not apply: use 'gpu_reduce'."
            )
        if not isinstance(self.prefetch_window, int) or self.prefetch_window < 1:
            raise ValueError(f"prefetch_window must be an integer >= 1, got {self.prefetch_window!r}.")
        if self.update_threads is not None and (not isinstance(self.update_threads, int) or self.update_threads < 1):
            raise ValueError(f"update_threads must be None (auto) or an integer >= 1, got {self.update_threads!r}.")
        if self.chunk_bytes not in (None, "auto") and (not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 64):
            raise ValueError(
                f"chunk_bytes must be None (one chunk per unit), 'auto' or an integer >= 64, got {self.chunk_bytes!r}."
            )
        if not isinstance(self.activation_policy, ActivationPolicy):
            raise TypeError("EngineConfig.activation_policy must be an ActivationPolicy; use "
                            "ActivationPolicy.coerce(...) for strings, dicts and JSON paths.")  # fmt: skip
        if self.loss_chunk_tokens is not None and (
            not isinstance(self.loss_chunk_tokens, int) or self.loss_chunk_tokens < 1
        ):
            raise ValueError(f"loss_chunk_tokens must be None or an integer >= 1, got {self.loss_chunk_tokens!r}.")
        if not isinstance(self.max_units_in_flight, int) or self.max_units_in_flight < 1:
            raise ValueError(f"max_units_in_flight must be an integer >= 1, got {self.max_units_in_flight!r}.")
        if self.update not in UPDATE_MODES:
            raise ValueError(f"update must be one of {UPDATE_MODES}, got {self.update!r}.")
        if not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ValueError(f"accumulate must be an integer >= 1, got {self.accumulate!r}.")
        if not isinstance(self.staging_slots, int) or self.staging_slots < 1:
            raise ValueError(f"staging_slots must be an integer >= 1, got {self.staging_slots!r}.")


class UnsupportedLayoutError(RuntimeError):
    """An operation that needs whole parameters on a host, asked of host-sharded ledgers."""


@dataclass(frozen=True)
class HostGroups:
    """Where one host's engine sits among several hosts (one ledger per host, full state on each).

    ``cross``: the ranks with this local rank on every host (reduced gradient shards are all-reduced there);
    ``leaders``: local rank 0 of every host (initial weights); ``world``: all ranks (checkpoints, agreement).
    """

    count: int = 1
    index: int = 0
    global_rank: int = 0
    cross: object = None
    leaders: object = None
    world: object = None
    sharded: bool = False  # host-sharded ledgers: the engine spans all hosts, each host's ledger holds 1/N
    local: object = None  # host-sharded: this host's ranks (ledger creation)


def find_streamed_model(root: nn.Module) -> nn.Module:
    """The first submodule of ``root`` (itself included) that an architecture adapter understands."""
    last_error: UnsupportedModelError | None = None
    for module in root.modules():
        try:
            adapter_for(module)
            return module
        except UnsupportedModelError as err:
            last_error = err
    assert last_error is not None
    raise last_error


class SlideDPEngine:
    """Owns the ledger, the device buffers, the hooks and the lanes of one rank."""

    def __init__(
        self,
        root: nn.Module,
        config: EngineConfig,
        *,
        device: torch.device,
        compute_dtype: torch.dtype,
        rank: int = 0,
        world_size: int = 1,
        local_rank: int = 0,
        local_world_size: int = 1,
        group=None,
        planner=None,
        hosts: HostGroups | None = None,
    ) -> None:
        if local_world_size != world_size and not (hosts is not None and hosts.sharded):
            raise ValueError(
                "SlideDP keeps one ledger per host and runs on a single host for now: "
                f"world size {world_size} spans more than this host's {local_world_size} ranks."
            )
        self.root = root
        self.config = config
        self.device = device
        self.compute_dtype = compute_dtype
        self.rank, self.world_size = rank, world_size
        self.local_rank, self.local_world_size = local_rank, local_world_size
        self.group = group
        # several hosts: this engine works within its host (rank/world_size/group are host-local) and joins
        # the other hosts' engines through these groups
        self.hosts = hosts or HostGroups()
        self.global_rank = self.hosts.global_rank if hosts else rank
        self._planner = planner  # chooses the activation policy at the first training forward (AutoPolicy)
        self.skipped = False  # the last end_step skipped a step with a non-finite gradient
        self.last_grad_norm: float | None = None  # deferred mode: the last step's global gradient norm
        self.step = 0  # optimizer steps whose updates have all been dispatched
        self._optimizer: torch.optim.Optimizer | None = None
        self._handles: list = []
        self._closed = False
        self._aborted = False
        self.ledger: HostLedger | None = None
        self.lane: UpdateLane | None = None
        self._setup()

    # -- setup ---------------------------------------------------------------------------------------
    def _collective_check(self, fn) -> object:
        """Run ``fn`` on rank 0; every rank receives its result or raises its error (no rank hangs)."""
        result: list = [None]
        if self.local_rank == 0:
            try:
                result[0] = ("ok", fn())
            except Exception as exc:  # re-raised on every rank below
                result[0] = ("error", exc)
        group = self.hosts.local if self.hosts.sharded else self.group
        if self.local_world_size > 1:
            dist.broadcast_object_list(result, group=group, group_src=0)
        status, value = result[0]
        if status == "error":
            raise value
        return value

    def _setup(self) -> None:
        t0 = time.perf_counter()
        model = find_streamed_model(self.root)
        self.adapter = adapter_for(model)
        self.model = model
        # replicated: the SlideFormer-style baseline, every rank a ledger of its own (R x host memory and traffic)
        self.replicated = self.config.param_route == "replicated" and self.world_size > 1
        self.owner_rank, owners = (0, 1) if self.replicated else (self.rank, self.world_size)
        specs = self.adapter.units(model)
        self.layout: Layout = build_layout(self.root, specs, self.world_size, owners)
        self._blocks = {i: spec.modules[0] for i, spec in enumerate(specs) if spec.block}
        # host-sharded ledgers: this host owns (and its ledger holds) a contiguous 1/N of every unit
        self.host_sharded = self.hosts.sharded
        size = self.local_world_size
        self._owners = slice(self.hosts.index * size, (self.hosts.index + 1) * size) if self.host_sharded else slice(None)
        self._host_ranges = [
            (u.offset + self._owners.start * u.shard_numel, u.offset + self._owners.stop * u.shard_numel)
            for u in self.layout.units
        ] if self.host_sharded else None  # fmt: skip
        self._param_group = None
        self.route_probe: RouteProbe | None = None
        self._resolve_auto()
        grad_bytes = 2 if self.compute_dtype == torch.bfloat16 else 4
        host_reduce = self.config.grad_route == "host_reduce"
        geometry = LedgerGeometry(
            total=self.layout.total,
            num_units=len(self.layout.units),
            world_size=owners,
            staging_slots=self.config.staging_slots if host_reduce else 0,
            staging_elems=self.layout.max_unit if host_reduce else 0,
            staging_itemsize=grad_bytes,
        )
        self.adapter.materialize_buffers(model)
        copies = self.local_world_size if self.replicated else (1 / self.hosts.count if self.host_sharded else 1)

        def create() -> str:
            remove_stale_ledgers()  # before the preflight: a dead job's ledger may hold the room this one needs
            check_host_memory(geometry, self.layout.num_params, copies)
            job = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT") or "local"
            path = ledger_path(f"{job}-host{self.hosts.index}")
            ledger = HostLedger(path, geometry, create=True)
            try:
                self._load_initial_weights(ledger)
                if self.hosts.leaders is not None and not self.host_sharded:  # every host: global rank 0's weights
                    dist.broadcast(ledger.master, src=0, group=self.hosts.leaders)
                    ledger.refresh_bf16()
            except BaseException:
                ledger.close()
                raise
            self.ledger = ledger
            return path

        if self.replicated:
            self._collective_check(lambda: check_host_memory(geometry, self.layout.num_params, copies))
            create()
            self.ledger.unlink()
            dist.broadcast(self.ledger.master, group=self.group, group_src=0)  # DDP's rule: rank 0's weights
            self.ledger.refresh_bf16()
            self.ledger.pids[0] = os.getpid()
        else:
            path = self._collective_check(create)
            if self.ledger is None:
                self.ledger = HostLedger(path, geometry, create=False)
            self.ledger.pids[self.local_rank] = os.getpid()
            self._barrier()
            self.ledger.unlink()  # every rank has mapped it: the name is no longer needed
        if self.device.type == "cuda":
            self.ledger.pin()
        self.liveness = Liveness(
            pids=lambda: [int(p) for i, p in enumerate(self.ledger.pids) if p != os.getpid()],
            timeout_s=self.config.timeout_s,
            own_error=self._lane_error,
        )
        self.tracer = Tracer(self.config.trace_dir, self.global_rank)
        self.lanes = make_lanes(self.device, self.tracer)
        set_lane_delay(self.config.lane_delay_ms)
        if self.config.lane_delay_ms:
            log.warning("SlideDP fault injection: random delays up to %.1f ms in every lane", self.config.lane_delay_ms)
        # the H2D lane issues all-gathers while backward issues reduce-scatters: separate groups keep each
        # group's collectives in one deterministic order
        route = "sharded" if self.config.param_route == "sharded" and self.world_size > 1 else "full"
        if route == "sharded" and self._param_group is None:
            self._param_group = self._new_host_group()
        param_group = self._param_group
        self.residency = UnitResidency(
            self.layout, self.ledger, self.lanes, self.compute_dtype, self.config.prefetch_window, self.liveness,
            route, self.owner_rank, param_group,
        )  # fmt: skip
        self.residency.bind()
        self.activations = ActivationManager(
            self._blocks, [u.name for u in self.layout.units], self.config.activation_policy, self.lanes,
            self.residency.resident_storages, partial(self._planner, self) if self._planner else None,
        )  # fmt: skip
        self.activations.install()
        if self.config.loss_chunk_tokens:
            chunked_loss.install(self.model, self.config.loss_chunk_tokens)
        self.routes = GradRoute(
            "all_reduce" if self.replicated else self.config.grad_route, self.layout, self.ledger, self.rank,
            self.world_size, self.group, self.lanes, self.liveness,
            self.config.chunk_bytes // 4 // 16 * 16 if self.config.chunk_bytes else None,
            cross_group=self.hosts.cross,
            reduce_world=self.world_size * (1 if self.host_sharded else self.hosts.count),
        )  # fmt: skip
        threads = cpu_ops.thread_budget(self.local_world_size, self.config.update_threads)
        torch_threads = torch.get_num_threads()
        # Numba kernels run on the update lane thread only: its OpenMP runtime is torch's, and a kernel launched
        # on the training thread would change torch's thread count there (oversubscription, other numerics)
        self.lane = UpdateLane(self.ledger, self.layout, self.owner_rank, threads, self.tracer, (self.world_size,))
        self._install_hooks()
        jit_s = self.lane.wait_ready()
        trim_host_heap()  # the model's original parameters are gone: return their memory to the OS
        if torch.get_num_threads() != torch_threads:
            raise RuntimeError(f"torch's thread count changed during SlideDP setup ({torch_threads} -> "
                               f"{torch.get_num_threads()}); a CPU kernel ran on the training thread")
        gib = 1 << 30
        log.log(
            logging.INFO if self.rank == 0 else logging.DEBUG,
            "SlideDP rank %d/%d: %d units, %s params, ledger %.3f GiB in shared memory (%.2f B/param), "
            "route %s/%s, window %d, %s %s, %d update thread(s), kernels ready in %.2f s, setup %.2f s",
            self.rank, self.world_size, len(self.layout.units), f"{self.layout.num_params:,}",
            geometry.nbytes / gib, geometry.nbytes / self.layout.num_params, self.config.param_route,
            self.config.grad_route, self.config.prefetch_window, self.device, self.compute_dtype, threads,
            jit_s, time.perf_counter() - t0,
        )  # fmt: skip

    def _resolve_auto(self) -> None:
        """Replace every "auto" of the config by the route the probe measured fastest (same on every rank)."""
        cfg = self.config
        want = (cfg.param_route == "auto", cfg.grad_route == "auto", cfg.chunk_bytes == "auto")
        if not any(want):
            return
        if self.world_size == 1:
            self.config = replace(
                cfg,
                param_route="full" if want[0] else cfg.param_route,
                grad_route="gpu_reduce" if want[1] else cfg.grad_route,
                chunk_bytes=None if want[2] else cfg.chunk_bytes,
            )
            log.info("SlideDP auto routes: one rank, nothing to choose: full / gpu_reduce / one chunk per unit")
            return
        if want[0]:
            self._param_group = self._new_host_group()
        pin = self.device.type == "cuda"
        scratch = torch.zeros(self.layout.max_unit, dtype=self.compute_dtype, pin_memory=pin)
        probe = probe_routes(
            scratch, self.layout.max_unit, rank=self.rank, world_size=self.world_size, device=self.device,
            dtype=self.compute_dtype, group=self.group, param_group=self._param_group, want_param=want[0],
            want_grad=want[1], want_chunks=want[2],
        )  # fmt: skip
        self.route_probe = probe
        self.config = replace(
            cfg,
            param_route=probe.param_route if want[0] else cfg.param_route,
            grad_route=probe.grad_route if want[1] else cfg.grad_route,
            chunk_bytes=probe.chunk_bytes if want[2] else cfg.chunk_bytes,
        )
        measured = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(probe.seconds.items()))
        log.log(
            logging.INFO if self.rank == 0 else logging.DEBUG,
            "SlideDP auto routes on a %s-element unit, all %d ranks at once (max over ranks): %s -> param_route=%s, "
            "grad_route=%s, chunk_bytes=%s",
            f"{self.layout.max_unit:,}", self.world_size, measured, self.config.param_route, self.config.grad_route,
            self.config.chunk_bytes,
        )  # fmt: skip

    def _lane_error(self) -> BaseException | None:
        """A failure of this rank's own update or D2H lane (ends every wait on the other ranks at once)."""
        if self.lane is not None and self.lane.error is not None:
            return self.lane.error
        return self.routes.error if hasattr(self, "routes") else None

    def _stamp(self):
        """Tracing: a timestamp on the compute lane (None when tracing is off)."""
        return self.lanes.stamp("compute") if self.tracer.enabled else None

    def _new_host_group(self):
        """A new process group of this host's ranks (every rank of every host creates every host's group); with
        host-sharded ledgers, of all ranks (every rank gathers every unit from all hosts)."""
        if self.hosts.count == 1 or self.host_sharded:
            return dist.new_group(list(range(self.world_size)))
        size = self.world_size
        groups = [dist.new_group(list(range(h * size, (h + 1) * size))) for h in range(self.hosts.count)]
        return groups[self.hosts.index]

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def _load_initial_weights(self, ledger: HostLedger) -> None:
        """Copy the model's weights (materializing meta units one at a time) into a new ledger (a new file reads
        as zeros: moments, gaps and padding need no writing)."""
        if self.host_sharded:
            return self._load_host_slices(ledger)
        for unit in self.layout.units:
            self._copy_unit_weights(unit, ledger.master[unit.offset : unit.offset + unit.padded])
        ledger.refresh_bf16()

    def _load_host_slices(self, ledger: HostLedger) -> None:
        """Host-sharded: global rank 0's weights, unit by unit, of which this host keeps only its slice."""
        for unit, (a, b) in zip(self.layout.units, self._host_ranges):
            flat = torch.zeros(unit.padded)
            self._copy_unit_weights(unit, flat)
            if self.hosts.leaders is not None:
                dist.broadcast(flat, src=0, group=self.hosts.leaders)
            ledger.master[a:b].copy_(flat[a - unit.offset : b - unit.offset])
        ledger.refresh_bf16(self._host_ranges)

    def _copy_unit_weights(self, unit, flat: torch.Tensor) -> None:
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

    def _refuse_host_sharded(self, what: str) -> None:
        if self.host_sharded:
            raise UnsupportedLayoutError(
                f"{what} reads whole parameters, and with host-sharded ledgers each host holds 1/N of them. Save "
                "distributed checkpoints (checkpoint_format='distributed', the default): they resume with either "
                "host layout, and `python -m slidedp_lightning.export CHECKPOINT OUT` exports one offline."
            )

    def _materialize(self, module: nn.Module) -> None:
        module.to_empty(device="cpu", recurse=True)
        with torch.no_grad():
            self.adapter.init_weights(self.model, module)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Validate the user's optimizer and map every parameter to its param group."""
        validate_optimizer(optimizer)
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        table, missing = [], []
        for unit in self.layout.units:
            row = []
            for slot in unit.slots:
                module, attr = slot.locations[0]
                gi = group_of.get(id(getattr(module, attr)))
                if gi is None:
                    missing.append(slot.name)
                row.append(gi if gi is not None else 0)
            table.append(row)
        if missing:
            raise ValueError(
                f"{len(missing)} trainable parameters are not in the optimizer (e.g. {missing[:3]}). SlideDP "
                "updates every parameter it streams: pass all of self.parameters() to the optimizer, "
                "created in configure_optimizers (after the model is built)."
            )
        self.lane.set_groups(table)
        self._optimizer = optimizer

    # -- hooks ---------------------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(lambda m, a: self.residency.begin_forward()))
        for module, units in self.layout.compute_modules:
            self._handles.append(module.register_forward_pre_hook(self._make_pre_forward(units)))
            self._handles.append(module.register_forward_hook(self._make_post_forward(units)))
        self._slot_of: dict[int, tuple[int, int]] = {}
        for ui, unit in enumerate(self.layout.units):
            for si, _ in enumerate(unit.slots):
                p = self.residency.param(ui, si)
                self._slot_of[id(p)] = (ui, si)
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._reset_step_grads()

    def _reset_backward(self) -> None:
        self._grads: list[list[torch.Tensor | None]] = [[None] * len(u.slots) for u in self.layout.units]
        self._pending = [len(u.slots) for u in self.layout.units]
        self._callback_queued = False

    def _reset_step_grads(self) -> None:
        self._reset_backward()
        self._micro = 0  # backward passes completed in this optimizer step
        self._any_grad = False
        self._hyper = None
        self._step_t0: float | None = None  # tracing: the step's first training forward
        self._mark = None  # tracing: when the compute lane last resumed compute (see Lanes.stamp)

    def _make_pre_forward(self, units: tuple[int, ...]):
        def hook(module, args):
            self.lane.raise_if_failed()
            lane_delay()
            if self.tracer.enabled and self._step_t0 is None and torch.is_grad_enabled():
                self._step_t0 = time.perf_counter()
            self.residency.acquire(units, self.step, backward=False)
            self._mark = self._stamp()

        return hook

    def _make_post_forward(self, units: tuple[int, ...]):
        def hook(module, args, output):
            if self.tracer.enabled and torch.is_grad_enabled():
                self.tracer.record("compute", "forward", self.step, self._mark, self._stamp(), units[-1])
                self._mark = None  # loss, logging and the loop run outside the units: backward starts at its hook
            self.residency.release(units)
            if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: self._on_output_grad(units))

        return hook

    def _on_output_grad(self, units: tuple[int, ...]) -> None:
        if self._micro >= self.config.accumulate:
            raise RuntimeError(
                f"SlideDP received a second gradient for this optimizer step: backward pass {self._micro + 1} with "
                f"accumulate={self.config.accumulate}. Close each step (optimizer_step / end_step) after "
                f"{self.config.accumulate} backward pass(es), or raise accumulate_grad_batches."
            )
        done = [self.layout.units[u].name for u in units if self._pending[u] == 0]
        if done:
            # the unit's gradient already went to the update lane and its device buffer is gone: stop before
            # autograd reads it
            raise RuntimeError(
                f"SlideDP: one backward pass reached unit(s) {done} a second time, after their gradient was "
                "reduced and handed to the CPU update (a module called twice in one forward, or retain_graph "
                "backward passes); each unit takes part in a forward pass once."
            )
        self._compute_until_now(units[-1])
        self.residency.acquire(units, self.step, backward=True)  # waiting here is traced as a stall
        for u in units:
            self.activations.prefetch(u)
        self._mark = self._stamp()

    def _compute_until_now(self, unit: int) -> None:
        """Tracing: the compute thread ran backward from the last mark until this hook."""
        if self.tracer.enabled and self._mark is not None:
            self.tracer.record("compute", "backward", self.step, self._mark, self._stamp(), unit)

    def _on_grad(self, param: torch.Tensor) -> None:
        ui, si = self._slot_of[id(param)]
        grad, param.grad = param.grad, None
        if self._grads[ui][si] is not None or self._pending[ui] == 0:
            raise RuntimeError(
                f"SlideDP received a second gradient for {self.layout.units[ui].slots[si].name} in one backward "
                "pass; each parameter takes part in a forward pass once."
            )
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._check_backward_complete)
            self._callback_queued = True
        self._any_grad = True
        self._grads[ui][si] = grad
        self._pending[ui] -= 1
        if self._pending[ui] == 0:
            self._unit_ready(ui)

    def _unit_ready(self, u: int) -> None:
        self._compute_until_now(u)
        self.residency.release_backward(u)
        grads, self._grads[u] = self._grads[u], [None] * len(self._grads[u])
        if self._optimizer is None:
            raise RuntimeError("SlideDP got gradients but no optimizer is attached; call attach_optimizer first.")
        if self._hyper is None:
            self._hyper = read_hyper(self._optimizer)
        if self.lane._units_in_flight >= self.config.max_units_in_flight:
            with self.tracer.span("stall", "wait update lane", self.step, u):
                self.lane.wait_units_below(self.config.max_units_in_flight, self.liveness)
        with self.tracer.span("reduce", "issue", self.step, u):
            chunks = self.routes.dispatch(u, grads, self.step)
        action = self._action()
        for k, (lo, hi, source) in enumerate(chunks):
            last = k == len(chunks) - 1
            self.lane.submit(UpdateTask(u, self.step + 1, self._hyper, source, lo, hi, last, k, self.routes.grad_scale,
                                        action, first=self._micro == 0))  # fmt: skip
        self._mark = self._stamp()

    def _action(self) -> str:
        """What the update lane does with the gradient of the backward pass now running."""
        if self.config.update == "deferred" or self._micro < self.config.accumulate - 1:
            return "accumulate"
        return "accumulate_update" if self._micro else "update"

    def _check_backward_complete(self) -> None:
        self._compute_until_now(0)
        self._mark = None
        self._callback_queued = False
        missing = [
            s.name for ui, u in enumerate(self.layout.units) if self._pending[ui] for s, g in zip(u.slots, self._grads[ui])
            if g is None
        ]  # fmt: skip
        if missing:
            raise RuntimeError(
                f"{len(missing)} parameters received no gradient in this backward pass (e.g. {missing[:3]}). "
                "SlideDP updates each unit once per step and needs every parameter to take part in the loss."
            )
        self._micro += 1
        self._reset_backward()

    # -- step boundary -------------------------------------------------------------------------------
    def end_step(self, clip_norm: float | None = None, clip_value: float | None = None, grad_scale: float = 1.0) -> bool:
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
        if self.tracer.enabled:
            self.tracer.mark_step(self.step, self._step_t0 or time.perf_counter(), time.perf_counter())
        self.activations.end_step()
        applied = True
        if self.config.update == "deferred" or self._micro < self.config.accumulate:
            applied = self._apply_accumulated(clip_norm, clip_value, grad_scale)
        elif clip_norm or clip_value or grad_scale != 1.0:
            raise RuntimeError("clipping and gradient scaling need update='deferred' (the engine was built with "
                               "update='immediate')")  # fmt: skip
        if applied:
            self.step += 1
            if self.step == 1:  # the first step's one-off allocations (JIT, warm-up) are done
                trim_host_heap()
        self._reset_step_grads()
        return applied

    def _apply_accumulated(self, clip_norm: float | None, clip_value: float | None, grad_scale: float) -> bool:
        """Check, clip and apply this rank's accumulated shards (forward order: the next step needs unit 0 first)."""
        if self._hyper is None:
            self._hyper = read_hyper(self._optimizer)
        self.lane.wait_idle(self.liveness)
        squares = self.lane.call(lambda: cpu_ops.sum_squares(self.lane.accumulator())).result()
        total = torch.tensor([squares], dtype=torch.float64)
        if self.world_size > 1 and not self.replicated:  # shards are disjoint: the global norm sums them
            dist.all_reduce(total, group=self.group)
        elif self.world_size > 1:  # every rank holds the whole gradient: agree on non-finite values
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.group)
        norm = float(total.sqrt()) * abs(grad_scale)
        self.last_grad_norm = norm
        if not math.isfinite(norm):
            log.warning("SlideDP: non-finite gradient (global norm %s) in step %d: the step is skipped on every "
                        "rank, weights and moments untouched.", norm, self.step)  # fmt: skip
            self.skipped = True
            return False
        scale = grad_scale
        if clip_norm:
            scale *= min(1.0, clip_norm / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s coefficient
        clamp = clip_value / abs(grad_scale) if clip_value else None  # in the accumulator's (scaled) units
        for u, unit in enumerate(self.layout.units):
            s0, s1 = unit.shard(self.owner_rank)
            chunks = self.routes._chunks(s1 - s0)
            for k, (lo, hi) in enumerate(chunks):
                self.lane.submit(UpdateTask(u, self.step + 1, self._hyper, None, lo, hi, k == len(chunks) - 1, k,
                                            scale, "update_from_acc", clamp=clamp))  # fmt: skip
        return True

    def synchronize(self) -> None:
        """Wait until every rank's updates of every dispatched step are in the ledger."""
        self.lane.wait_idle(self.liveness)
        version = self.ledger.version[:, self._owners]  # the owners whose shards this host's ledger holds
        wait_until(lambda: bool((version >= self.step).all()), self.liveness, "all ranks' updates")

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

    def ledger_stats(self) -> LedgerStats:
        """The size of this host's ledger and the memory it holds now."""
        assert self.ledger is not None
        copies = self.local_world_size if self.replicated else (1 / self.hosts.count if self.host_sharded else 1)
        return LedgerStats(
            nbytes=self.ledger.geometry.nbytes,
            num_params=self.layout.num_params,
            padded_params=self.layout.total,
            allocated_bytes=self.ledger.allocated_bytes(),
            copies=copies,
        )

    # -- state ---------------------------------------------------------------------------------------
    def master_view(self, unit_index: int, slot_index: int) -> torch.Tensor:
        unit = self.layout.units[unit_index]
        slot = unit.slots[slot_index]
        start = unit.offset + slot.offset
        return self.ledger.master[start : start + slot.numel].view(slot.shape)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The root module's state dict with FP32 master weights (copies), keyed as ``root.state_dict()``."""
        self._refuse_host_sharded("state_dict")
        self.synchronize()
        out = {}
        for name, t in self.root.state_dict(keep_vars=True).items():
            where = self._slot_of.get(id(t))
            out[name] = self.master_view(*where).clone() if where is not None else t.detach().clone()
        return out

    def named_slots(self) -> dict[str, tuple[int, int]]:
        """Each ledger parameter once (a tied one under its first name), keyed as ``root.state_dict()``."""
        out: dict[str, tuple[int, int]] = {}
        seen: set[tuple[int, int]] = set()
        for name, t in self.root.state_dict(keep_vars=True).items():
            where = self._slot_of.get(id(t))
            if where is not None and where not in seen:
                seen.add(where)
                out[name] = where
        return out

    def ledger_tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Views into the shared ledger for the parameters ``names``: ``model/<name>``, ``exp_avg/<name>`` and
        ``exp_avg_sq/<name>`` (writing into them writes the ledger). With host-sharded ledgers only this host's
        elements of each view (:meth:`host_parts`) are valid."""
        slots = self.named_slots()
        out = {}
        for name in names:
            where = slots[name]
            m, v = self.moments(*where)
            out[f"model/{name}"], out[f"exp_avg/{name}"], out[f"exp_avg_sq/{name}"] = self.master_view(*where), m, v
        return out

    def host_parts(self, where: tuple[int, int]) -> list[tuple[int, int]]:
        """Each host's elements ``[lo, hi)`` of a parameter, counted from its first element (``lo == hi``: none).
        One host holding everything unless the ledgers are host-sharded."""
        unit = self.layout.units[where[0]]
        slot = unit.slots[where[1]]
        if not self.host_sharded:
            return [(0, slot.numel)]
        per_host = self.local_world_size * unit.shard_numel
        parts = []
        for h in range(self.hosts.count):
            lo = min(max(h * per_host, slot.offset), slot.offset + slot.numel)
            hi = max(min((h + 1) * per_host, slot.offset + slot.numel), lo)
            parts.append((lo - slot.offset, hi - slot.offset))
        return parts

    def buffers_state(self) -> dict[str, torch.Tensor]:
        """The root's state entries that are not ledger parameters (persistent buffers), as copies."""
        return {n: t.detach().clone() for n, t in self.root.state_dict(keep_vars=True).items()
                if id(t) not in self._slot_of}  # fmt: skip

    def drop_resident(self) -> None:
        """Before the ledger's weights are rewritten: no fill may still read them, and no unit may stay resident
        with the old ones."""
        self.residency.evict_all()
        self.lanes.drain()

    def restored(self, step: int, buffers: dict[str, torch.Tensor]) -> None:
        """After every rank wrote its part of a checkpoint into the ledger: BF16 copy, step count, stamps."""
        own = self.root.state_dict(keep_vars=True)
        for name, value in buffers.items():
            if name in own and id(own[name]) not in self._slot_of:
                own[name].data.copy_(value)
        self._barrier()
        if self.local_rank == 0 or self.replicated:
            self.ledger.refresh_bf16(self._host_ranges)
            self.ledger.version[:] = step
        self._barrier()
        self.step = step

    def moments(self, unit_index: int, slot_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        unit = self.layout.units[unit_index]
        slot = unit.slots[slot_index]
        start = unit.offset + slot.offset
        sl = slice(start, start + slot.numel)
        return self.ledger.exp_avg[sl].view(slot.shape), self.ledger.exp_avg_sq[sl].view(slot.shape)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """``optimizer.state_dict()`` as torch's Adam/AdamW would return it, with the moments from the ledger."""
        self._refuse_host_sharded("optimizer_state_dict")
        self.synchronize()
        groups = optimizer.state_dict()["param_groups"]
        state, index = {}, 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                if self.step > 0:
                    exp_avg, exp_avg_sq = self.moments(*self._slot_of[id(p)])
                    state[index] = {
                        "step": torch.tensor(float(self.step)),
                        "exp_avg": exp_avg.clone(),
                        "exp_avg_sq": exp_avg_sq.clone(),
                    }
                index += 1
        return {"state": state, "param_groups": groups}

    def _write_slot(self, where: tuple[int, int], value: torch.Tensor, target: str) -> None:
        unit = self.layout.units[where[0]]
        slot = unit.slots[where[1]]
        if tuple(value.shape) != slot.shape:
            raise ValueError(f"{slot.name}: checkpoint shape {tuple(value.shape)} != model shape {slot.shape}.")
        start = unit.offset + slot.offset
        getattr(self.ledger, target)[start : start + slot.numel].copy_(value.reshape(-1))

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Write weights (keyed as ``root.state_dict()``) into the FP32 master and its BF16 copy."""
        self._refuse_host_sharded("load_state_dict")
        self.synchronize()
        self.drop_resident()
        own = self.root.state_dict(keep_vars=True)
        if strict:
            missing = sorted(set(own) - set(state_dict))
            unexpected = sorted(set(state_dict) - set(own))
            if missing or unexpected:
                raise KeyError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        if self.local_rank == 0 or self.replicated:
            for name, value in state_dict.items():
                where = self._slot_of.get(id(own[name])) if name in own else None
                if where is not None:
                    self._write_slot(where, value, "master")
                elif name in own:
                    own[name].data.copy_(value)
            self.ledger.refresh_bf16()
        self._barrier()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Restore moments, step count and group hyper-parameters saved by :meth:`optimizer_state_dict`."""
        self._refuse_host_sharded("load_optimizer_state_dict")
        self.synchronize()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        saved = state.get("state", {})
        steps = {int(s["step"]) for s in saved.values()} or {0}
        if len(steps) != 1:
            raise ValueError(f"SlideDP keeps one step count for all parameters; the checkpoint has {sorted(steps)}.")
        if self.local_rank == 0 or self.replicated:
            for index, s in saved.items():
                where = self._slot_of[id(params[int(index)])]
                self._write_slot(where, s["exp_avg"], "exp_avg")
                self._write_slot(where, s["exp_avg_sq"], "exp_avg_sq")
            self.ledger.version[:] = steps.pop() if steps else 0
        for group, saved_group in zip(optimizer.param_groups, state.get("param_groups", [])):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        self._barrier()
        self.step = int(self.ledger.version.min())

    def abort(self) -> None:
        """After an error: stop waiting on other ranks; teardown will not synchronize."""
        self._aborted = True

    # -- teardown ------------------------------------------------------------------------------------
    def _restore_fits(self) -> bool:
        if self.host_sharded:  # no host holds whole parameters
            log.warning("SlideDP: host-sharded ledgers: the module's parameters are left on the meta device.")
            return False
        """Whether FP32 copies of the model on every local rank fit comfortably in the host's free memory."""
        need = self.layout.num_params * 4 * self.local_world_size
        available = available_host_bytes()[0]
        fits = need < available // 2
        if not fits:
            log.warning(
                "SlideDP: not restoring the module's parameters after training (%d ranks x %.1f GiB of FP32 "
                "copies would exceed half of the %.1f GiB available); they are left on the meta device. Save a "
                "checkpoint to keep the weights, or pass restore_module=True to force the copies.",
                self.local_world_size, self.layout.num_params * 4 / (1 << 30), available / (1 << 30),
            )  # fmt: skip
        return fits

    def close(self, restore: bool | str = "auto") -> None:
        """Stop the lanes, give the model ordinary parameters again and unmap the ledger.

        ``restore``: True = FP32 CPU copies of the master; False = meta tensors; "auto" = copies when they fit
        in half of the available host memory, else meta (with a warning).
        """
        if self._closed:
            return
        self._closed = True
        if restore == "auto" or self.host_sharded:
            restore = self._restore_fits()
        try:
            if self.lane is not None and self.lane.error is None and not self._aborted:
                self.synchronize()
        finally:
            for h in self._handles:
                h.remove()
            self._handles.clear()
            if hasattr(self, "activations"):
                self.activations.uninstall()
            chunked_loss.uninstall(self.model)
            if self.lane is not None:
                self.lane.close(wait_s=1.0 if self._aborted else 30.0)
            if hasattr(self, "routes"):
                self.routes.close()
            if hasattr(self, "tracer"):
                self.tracer.close()
            if hasattr(self, "residency"):
                self.residency.evict_all()
                self.residency.unbind(restore)
            if hasattr(self, "lanes"):
                self.lanes.close(wait=not self._aborted)
                if not self._aborted:
                    self.lanes.drain()  # no copy may still read the ledger when it is unpinned and unmapped
            if self.ledger is not None:
                self.ledger.close()
