"""What the Trainer and the Fabric strategies share: one rank's SlideDP run, whatever Lightning front end drives it.

:class:`SlideDPLifecycle` is mixed into :class:`~slidedp_lightning.SlideDPStrategy` (``Trainer``) and
:class:`~slidedp_lightning.fabric.SlideDPFabricStrategy` (``Fabric``), before their Lightning base class. It holds
the options (:class:`~slidedp_lightning.options.SlideDPOptions`), the process group (:mod:`process_groups`), the
:class:`Topology`, the engine, the signal guard, and does what both do alike: the ranks and devices, joining the
default group, building the engine, closing an optimizer step, the collectives, a failure and the teardown. Each
front end keeps only what its API differs in (how the model and optimizer arrive, checkpoints' outer form).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch import nn

from slidedp_lightning.autopolicy import AutoPolicy
from slidedp_lightning.hf.pretrained import loading_into_ledger, warn_if_materialized
from slidedp_lightning.options import SlideDPOptions
from slidedp_lightning.precision import LossScaling
from slidedp_lightning.process import groups as process_groups
from slidedp_lightning.process import signals
from slidedp_lightning.runtime.config import EngineConfig
from slidedp_lightning.runtime.engine import SlideDPEngine
from slidedp_lightning.runtime.topology import Topology

if TYPE_CHECKING:
    from lightning.fabric.plugins.environments import ClusterEnvironment

log = logging.getLogger(__name__)

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
START_METHODS = ("popen", "spawn", "fork", "forkserver")


class SlideDPLifecycle:
    """The front-end-independent part of a SlideDP strategy (see the module docstring)."""

    if TYPE_CHECKING:  # provided by the Lightning ParallelStrategy each front end derives from
        cluster_environment: ClusterEnvironment | None
        parallel_devices: list[torch.device] | None

        @property
        def global_rank(self) -> int: ...

        @property
        def local_rank(self) -> int: ...

        @property
        def node_rank(self) -> int: ...

        @property
        def launcher(self) -> Any: ...

    # the front end's script launcher class: the ``procs`` of an instance are the rank processes this one started
    script_launcher: ClassVar[type[Any]]

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register the front end as "slidedp" and "slidedp_spawn" (on the Trainer's or Fabric's registry)."""
        strategy_registry.register("slidedp", cls, description="SlideDP host-resident layer streaming")
        strategy_registry.register(
            "slidedp_spawn", cls, description="SlideDP, processes started with spawn", start_method="spawn"
        )

    def _init_lifecycle(self, options: SlideDPOptions, start_method: StartMethod, timeout: timedelta | None) -> None:
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}.")
        self.options = options
        # AutoPolicy keeps its plan: a later run of the same strategy reuses it instead of measuring
        self.planner: AutoPolicy | None = AutoPolicy() if options.activation_policy == "auto" else options.planner
        self._start_method = start_method
        self._timeout = timeout or default_pg_timeout
        self._num_nodes = 1
        self.topology: Topology | None = None
        self.engine: SlideDPEngine | None = None
        self._released_steps = 0  # optimizer steps of the last engine, whose state went with its ledger
        self._failed = False  # a failure was reported in this run: teardown waits on no other rank
        self._signals = signals.SignalGuard(lambda: f"rank {self.global_rank} (pid {os.getpid()})", self._launched)
        # deferred updates: the global gradient norm of the last optimizer step (None under immediate updates)
        self.last_grad_norm: float | None = None

    # -- ranks and devices ---------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self.options.check_nodes(num_nodes)
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:  # read by Lightning's accelerator connector (not a base method)
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def _launched(self) -> list[Any]:  # the ranks this process started (the script launcher's local rank 0)
        launcher: Any = self.launcher
        return list(launcher.procs) if isinstance(launcher, self.script_launcher) else []

    def _name_launcher(self) -> bool:
        """Before a script launcher is made: whether this process starts the other ranks (then it says so in the
        environment they inherit, so that they stop if it dies before they could ask to end with it)."""
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            return False
        signals.name_launcher()
        return True

    # -- the process group and the Topology -----------------------------------------------------------
    def _join_process_group(self) -> None:
        """After the base class set up the device: the default group (SlideDP's own unless the user made one)."""
        if dist.is_initialized():  # the user's group: refused before anything is set up if it lacks a CPU backend
            process_groups.check_host_backend()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        self._failed = False
        armed = signals.end_with_launcher(self.cluster_environment.creates_processes_externally)
        if dist.is_initialized():
            return  # the user's group (or, after a failed run, SlideDP's own: destroyed at the next good teardown)
        with signals.killed_with_launcher(armed):
            _init_dist_connection(
                self.cluster_environment, process_groups.backend_for(self.root_device), timeout=self._timeout
            )
        process_groups.claim_default_group(self.cluster_environment.main_address, self.cluster_environment.main_port)

    def _topology(self, config: EngineConfig) -> Topology:
        """Every process group the runtime uses, for ``config``'s routes, created once per process (collectively,
        on every rank)."""
        if self.topology is None:
            self.topology = Topology.for_routes(
                config,
                global_rank=self.global_rank,
                local_rank=self.local_rank,
                ranks_per_host=self.num_processes,
                hosts=self.num_nodes,
                host_layout=self.options.host_layout,
            )
        return self.topology

    # -- the model and the engine ---------------------------------------------------------------------
    @contextmanager
    def _host_device(self, meta: bool | None) -> Generator[None, None, None]:
        """Where tensors are made: never on the accelerator (the weights go to the host ledger, and only units visit
        the device); ``meta``: on the meta device."""
        with torch.device("meta" if meta else "cpu"):
            yield

    @contextmanager
    def _ledger_context(self) -> Generator[None, None, None]:
        """Where the model is built: ``from_pretrained`` returns a meta skeleton whose checkpoint the engine reads
        into the ledger; ``meta_init=True``: on the meta device (units materialized one at a time later)."""
        with loading_into_ledger():
            with torch.device("meta") if self.options.meta_init else nullcontext():
                yield

    def _build_engine(self, model: nn.Module, config: EngineConfig, compute_dtype: torch.dtype, root_dir: str) -> None:
        """The engine for ``model`` (its parameters become views of streamed buffers); AutoPolicy's plan, once
        made, is reused, else it is saved under ``root_dir``."""
        planner = self.planner
        if planner is not None and planner.save_to is None:
            planner.save_to = os.path.join(root_dir, "slidedp_policy.json")
        if planner is not None and planner.plan is not None:
            config = replace(config, activation_policy=planner.plan.activations)
            planner = None
        topology = self._topology(config)
        warn_if_materialized(model, topology)
        self.engine = SlideDPEngine(
            model,
            config,
            device=self.root_device,
            compute_dtype=compute_dtype,
            topology=topology,
            planner=planner,
        )

    def _move_buffers(self, model: nn.Module) -> None:
        """Move buffers only: parameters are views into the engine's streamed device buffers."""
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None and buf.device != self.root_device:
                    module._buffers[name] = buf.to(self.root_device)

    # -- the step -------------------------------------------------------------------------------------
    def _end_step(
        self, optimizer: Any, clip_norm: float | None, clip_value: float | None, scaling: LossScaling
    ) -> bool:
        """Close the optimizer step in the engine (the deferred update, clipped, applied now); returns whether it
        produced updates. The loss scale follows whether the step was skipped."""
        assert self.engine is not None
        stepped = self.engine.end_step(clip_norm, clip_value, scaling.unscale_factor())
        self.last_grad_norm = self.engine.last_grad_norm
        scaling.update_scale(found_inf=self.engine.skipped)
        if stepped:
            # the step ran on the CPU update lane, not in optimizer.step(); tell torch's LR schedulers it happened
            optimizer._opt_called = True
        return stepped

    # -- collectives ---------------------------------------------------------------------------------
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    # -- failures and teardown -----------------------------------------------------------------------
    def _fail(self, exception: BaseException) -> None:
        """A failure on this rank: say which peers cannot be making progress, and wait on no other rank from now."""
        self._failed = True
        peers = self.engine.peer_states() if self.engine is not None else ""
        stuck = "; ".join(s for s in (peers, signals.ended_children(self._launched())) if s)
        if stuck:
            log.error("SlideDP rank %d failed (%s); %s.", self.global_rank, type(exception).__name__, stuck)
        if self.engine is not None:
            self.engine.abort()

    def _close_engine(self) -> None:
        """Close the engine, then (not after a failure) destroy the runtime's process groups."""
        self._signals.hold()
        if self.engine is not None:
            self._released_steps = self.engine.step
            self.engine.close()
            self.engine = None
        topology, self.topology = self.topology, None  # no reference to the runtime's groups outlives the run
        if topology is not None and not self._failed:
            topology.destroy_groups()
        del topology
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()

    def _end_run(self) -> None:
        """Last: the default group when this strategy created it, the launched ranks' fate, the signals back."""
        process_groups.destroy_default_group(self._timeout.total_seconds(), peers_alive=not self._failed)
        signals.LAUNCHED_AT_EXIT.update(self._launched(), self._failed, min(self._timeout.total_seconds(), 300.0))
        self._signals.release()
