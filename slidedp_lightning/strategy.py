"""``SlideDPStrategy``: the thin Lightning adapter around :class:`~slidedp_lightning.runtime.engine.SlideDPEngine`."""

from __future__ import annotations

import logging
import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from typing_extensions import override

from slidedp_lightning import checkpoint as sharded
from slidedp_lightning import export, process_groups, requeue, signals
from slidedp_lightning.autopolicy import AutoPolicy
from slidedp_lightning.callbacks import LaneTrace
from slidedp_lightning.checks import refuse_what_cannot_see_gradients
from slidedp_lightning.constants import CheckpointFormat, GradRoute, HostLayout, OptimizerState, ParamRoute, UpdateMode
from slidedp_lightning.options import ActivationOption, SlideDPOptions
from slidedp_lightning.precision import SUPPORTED_PRECISION, SlideDPPrecision
from slidedp_lightning.pretrained import loading_into_ledger, warn_if_materialized
from slidedp_lightning.runtime.engine import SlideDPEngine
from slidedp_lightning.runtime.topology import Topology

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
_START_METHODS = ("popen", "spawn", "fork", "forkserver")
_LOADED = "_slidedp_loaded_into_ledger"


class SlideDPStrategy(ParallelStrategy):
    """Full-parameter training of models larger than device memory on the devices of one or more hosts.

    One FP32 master copy of the weights and the Adam moments lives in host shared memory; units (embedding,
    decoder blocks, head) stream to each device just in time and each rank's CPU worker updates its 1/R
    shard of a unit as soon as that unit's gradient is reduced, overlapped with the rest of backward
    (arXiv 2609.34162; design in ``docs/ARCHITECTURE.md``).

    Args: the options of :class:`~slidedp_lightning.options.SlideDPOptions` (each documented there), and
        start_method: ``"popen"`` (script launcher) or a multiprocessing start method;
        timeout: process-group timeout; also bounds every wait on another rank.

    After fit/validate the LightningModule gets FP32 CPU parameters again when the copies fit in half of the free
    host memory (else meta, with a warning). Parameters hold no gradient after backward: ``last_grad_norm`` is the
    last deferred step's global norm; manual optimization and hooks that would read ``.grad`` are refused at setup
    (:mod:`slidedp_lightning.checks`). Lane tracing: :class:`~slidedp_lightning.LaneTrace`; the loss in chunks:
    :func:`~slidedp_lightning.use_chunked_loss`."""

    strategy_name = "slidedp"

    def __init__(
        self,
        *,
        param_route: ParamRoute | Literal["auto"] = "full",
        grad_route: GradRoute | Literal["auto"] = "gpu_reduce",
        chunk_bytes: int | Literal["auto"] | None = None,
        prefetch_window: int = 2,
        max_units_in_flight: int = 2,
        update_threads: int | None = None,
        activation_policy: ActivationOption = None,
        update: UpdateMode | Literal["auto"] = "auto",
        meta_init: bool = False,
        host_layout: HostLayout = "replicated",
        checkpoint_format: CheckpointFormat = "distributed",
        optimizer_state: OptimizerState = "fp32",
        bf16_copy: bool = True,
        start_method: StartMethod = "popen",
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__()
        if start_method not in _START_METHODS:
            raise ValueError(f"start_method must be one of {_START_METHODS}, got {start_method!r}.")
        # every argument but start_method and timeout is an option, checked by SlideDPOptions
        self.options = SlideDPOptions(
            param_route=param_route,
            grad_route=grad_route,
            chunk_bytes=chunk_bytes,
            prefetch_window=prefetch_window,
            max_units_in_flight=max_units_in_flight,
            update_threads=update_threads,
            activation_policy=activation_policy,
            update=update,
            meta_init=meta_init,
            host_layout=host_layout,
            checkpoint_format=checkpoint_format,
            optimizer_state=optimizer_state,
            bf16_copy=bf16_copy,
        )
        # AutoPolicy keeps its plan: a later fit/validate of the same strategy reuses it instead of measuring
        self.planner: AutoPolicy | None = AutoPolicy() if activation_policy == "auto" else self.options.planner
        self._start_method = start_method
        self._timeout = timeout or default_pg_timeout
        self._num_nodes = 1
        self._clip: tuple[float | None, str | None] = (None, None)
        self.topology: Topology | None = None
        self.engine: SlideDPEngine | None = None
        self._released_steps = 0  # optimizer steps of the last engine, whose state went with its ledger
        self._failed = False  # on_exception was called in this run: teardown waits on no other rank
        self._signals = signals.SignalGuard(lambda: f"rank {self.global_rank} (pid {os.getpid()})", self._launched)
        # deferred updates: the global gradient norm of the last optimizer step (None under immediate updates)
        self.last_grad_norm: float | None = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("slidedp", cls, description="SlideDP host-resident layer streaming")
        strategy_registry.register(
            "slidedp_spawn", cls, description="SlideDP, processes started with spawn", start_method="spawn"
        )

    # -- topology ------------------------------------------------------------------------------------
    @property
    @override
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
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def precision_plugin(self) -> SlideDPPrecision:
        plugin = self._precision_plugin
        return plugin if isinstance(plugin, SlideDPPrecision) else SlideDPPrecision("32-true")

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is None or isinstance(plugin, SlideDPPrecision):
            self._precision_plugin = plugin
            return
        name = getattr(plugin, "precision", None)
        if name not in SUPPORTED_PRECISION:
            raise ValueError(
                f"SlideDP supports precision {SUPPORTED_PRECISION}; got {name or type(plugin).__name__!r}. "
                "Use Trainer(precision='bf16-mixed'), '16-mixed' or '32-true'."
            )
        self._precision_plugin = SlideDPPrecision(name, getattr(plugin, "device", "cpu"))

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            if not self.cluster_environment.creates_processes_externally:
                signals.name_launcher()  # the ranks it starts stop if it dies before they could ask to end with it
                self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if dist.is_initialized():  # the user's group: refused before anything is set up if it lacks a CPU backend
            process_groups.check_host_backend()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        self._failed = False
        signals.end_with_launcher(self.cluster_environment.creates_processes_externally)
        if dist.is_initialized():
            return  # the user's group (or, after a failed run, SlideDP's own: destroyed at the next good teardown)
        _init_dist_connection(
            self.cluster_environment, process_groups.backend_for(self.root_device), timeout=self._timeout
        )
        process_groups.claim_default_group(self.cluster_environment.main_address, self.cluster_environment.main_port)

    def _topology(self) -> Topology:
        """Every process group the runtime uses, created once per process (collectively, on every rank)."""
        if self.topology is None:
            self.topology = self.options.topology(self.global_rank, self.local_rank, self.num_processes, self.num_nodes)
        return self.topology

    # -- setup ---------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            refuse_what_cannot_see_gradients(trainer)
        config = self.options.engine_config(
            clipping=fitting and bool(trainer.gradient_clip_val),
            scales_loss=self.precision_plugin.scales_loss,
            accumulate=trainer.accumulate_grad_batches if fitting else 1,
            timeout_s=self._timeout.total_seconds(),
            trace_dir=LaneTrace.dir_for(trainer),
        )
        self._clip = (trainer.gradient_clip_val, trainer.gradient_clip_algorithm) if fitting else (None, None)
        self.accelerator.setup(trainer)
        planner = self.planner
        if planner is not None and planner.save_to is None:
            planner.save_to = os.path.join(trainer.default_root_dir, "slidedp_policy.json")
        if planner is not None and planner.plan is not None:
            config = replace(config, activation_policy=planner.plan.activations)
            planner = None
        warn_if_materialized(self.model, self._topology())
        self.engine = SlideDPEngine(
            self.model,
            config,
            device=self.root_device,
            compute_dtype=self.precision_plugin.compute_dtype,
            topology=self._topology(),
            planner=planner,
        )
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ValueError(
                    f"SlideDP drives exactly one optimizer; configure_optimizers returned {len(self.optimizers)}."
                )
            self.engine.attach_optimizer(self.optimizers[0])
        self.setup_precision_plugin()

    @override
    def model_to_device(self) -> None:
        """Move buffers only: parameters are views into the engine's streamed device buffers."""
        assert self.model is not None
        for module in self.model.modules():
            for name, buf in module._buffers.items():
                if buf is not None and buf.device != self.root_device:
                    module._buffers[name] = buf.to(self.root_device)

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # never the accelerator: the weights go to the host ledger, and only units visit the device
        with torch.device("meta" if empty_init else "cpu"):
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        with loading_into_ledger():  # slidedp_lightning.from_pretrained: a meta skeleton, its checkpoint attached
            with torch.device("meta") if self.options.meta_init else nullcontext():
                yield

    # -- the step ------------------------------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        model = model or self.lightning_module
        result = self.precision_plugin.optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        assert self.engine is not None
        clip_val, algorithm = self._clip
        clip_norm = float(clip_val) if clip_val and algorithm != "value" else None
        clip_value = float(clip_val) if clip_val and algorithm == "value" else None
        stepped = self.engine.end_step(clip_norm, clip_value, self.precision_plugin.unscale_factor())
        self.last_grad_norm = self.engine.last_grad_norm
        self.precision_plugin.update_scale(found_inf=self.engine.skipped)
        if stepped:
            # the step ran on the CPU update lane, not in optimizer.step(); tell torch's LR schedulers it happened
            optimizer._opt_called = True
        return result

    # -- collectives ---------------------------------------------------------------------------------
    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    # -- state ---------------------------------------------------------------------------------------
    @property
    def checkpoint_format(self) -> str:
        return self.options.checkpoint_format

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Full format: FP32 master weights from the ledger, on global rank 0 (the rank that writes the file).
        Distributed format: nothing here, the ranks write the ledger itself in ``save_checkpoint``."""
        if self.engine is None:
            return super().lightning_module_state_dict()
        if self.checkpoint_format == "distributed":
            return {}
        return self.engine.state_dict() if self.is_global_zero else {}

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer state in ``torch.optim.AdamW.state_dict()`` form, read from the ledger."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if self.engine is None:
            if self._released_steps:
                raise RuntimeError(
                    "The Adam moments of this SlideDP run lived in the host ledger, released when the run ended. "
                    "Save full checkpoints during fit (ModelCheckpoint, or trainer.save_checkpoint from a callback), "
                    "or pass weights_only=True to save the final weights."
                )
            return optimizer.state_dict()
        if self.checkpoint_format == "distributed":  # the moments go with the ledger; keep the hyper-parameters
            return {"state": {}, "param_groups": optimizer.state_dict()["param_groups"]}
        return self.engine.optimizer_state_dict(optimizer) if self.is_global_zero else {}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Distributed format: a directory written by every rank through ``torch.distributed.checkpoint``,
        swapped into place atomically, Lightning's part of ``checkpoint`` stored as JSON and tensors (what has
        no such form is refused; see :mod:`slidedp_lightning.checkpoint`); full format: one file."""
        if self.engine is None or self.checkpoint_format == "full":
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(
                "SlideDP's distributed checkpoints do not use a CheckpointIO: drop storage_options, or "
                "pass checkpoint_format='full'."
            )
        sharded.save(self.engine, checkpoint, filepath)

    def save_hf(self, directory: Any, dtype: str | torch.dtype = torch.bfloat16, max_shard_size: str = "5GB") -> None:
        """Write a Hugging Face ``save_pretrained`` directory (safetensors + config) straight from the ledger, in
        BF16 or FP32, without materializing the model; call it on every rank (rank 0 writes)."""
        if self.engine is None:
            raise RuntimeError(
                "save_hf reads the host ledger, which exists only while the Trainer runs (fit or "
                "validate): call it from a callback or use SaveHuggingFace."
            )
        export.save_hf(self.engine, directory, dtype, max_shard_size)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Distributed format: read into the ledger. Nothing of such a checkpoint can run code when loaded (JSON,
        safetensors, DCP's tensors read with ``weights_only=True`` and its metadata checked before it is
        unpickled), so it loads alike whatever ``weights_only`` says. Full
        format: Lightning's ``torch.load`` with ``weights_only`` as given; when not given, True (torch's default,
        stated so that no environment setting can turn it off)."""
        if self.engine is not None and sharded.is_sharded(checkpoint_path):
            meta = sharded.load(self.engine, checkpoint_path)
            return {**meta, "state_dict": {}, _LOADED: True}
        if sharded.is_sharded(checkpoint_path):
            raise ValueError(
                f"{checkpoint_path} is a SlideDP distributed checkpoint: load it with "
                "Trainer(strategy=SlideDPStrategy(...)).fit(ckpt_path=...), which reads it into the "
                "ledger."
            )
        return super().load_checkpoint(checkpoint_path, weights_only=True if weights_only is None else weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.engine is not None
        if checkpoint.get(_LOADED):
            return  # read straight into the ledger by load_checkpoint
        self.engine.load_state_dict(checkpoint["state_dict"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.engine is not None
        states = checkpoint.get("optimizer_states", [])
        if not states:
            return
        if checkpoint.get(_LOADED):  # moments and step are in the ledger already: restore the hyper-parameters
            for group, saved in zip(self.optimizers[0].param_groups, states[0]["param_groups"]):
                group.update({k: v for k, v in saved.items() if k != "params"})
            return
        self.engine.load_optimizer_state_dict(self.optimizers[0], states[0])

    # -- signals, failures, teardown -----------------------------------------------------------------
    @override
    def on_train_start(self) -> None:
        self._signals.install(requeue.requeue_signal(self.lightning_module, self._signals))  # after Lightning's

    on_validation_start = on_test_start = on_predict_start = on_train_start

    def _launched(self) -> list[Any]:  # the ranks this process started (the script launcher's local rank 0)
        return list(self.launcher.procs) if isinstance(self.launcher, _SubprocessScriptLauncher) else []

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        peers = self.engine.peer_states() if self.engine is not None else ""
        stuck = "; ".join(s for s in (peers, signals.ended_children(self._launched())) if s)
        if stuck:
            log.error("SlideDP rank %d failed (%s); %s.", self.global_rank, type(exception).__name__, stuck)
        if self.engine is not None:
            self.engine.abort()

    @override
    def teardown(self) -> None:
        """Close the engine, then destroy the process groups of the run: the runtime's own groups, and the default
        group when this strategy created it (at the very end), so that no collective backend's thread is left to
        interpreter shutdown. After a failure the groups are left to the process's exit (see
        :func:`~slidedp_lightning.process_groups.destroy_default_group`). What happens to the rank processes this one
        launched when it exits: :class:`~slidedp_lightning.signals.LaunchedAtExit`."""
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
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        process_groups.destroy_default_group(self._timeout.total_seconds(), peers_alive=not self._failed)
        signals.LAUNCHED_AT_EXIT.update(self._launched(), self._failed, min(self._timeout.total_seconds(), 300.0))
        self._signals.release()
