"""``SlideDPStrategy``: the thin Lightning adapter around :class:`~slidedp_lightning.runtime.engine.SlideDPEngine`."""

from __future__ import annotations

import logging
import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
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

from slidedp_lightning import checkpoint as sharded
from slidedp_lightning import export
from slidedp_lightning.autopolicy import AutoPolicy
from slidedp_lightning.precision import SUPPORTED_PRECISION, SlideDPPrecision
from slidedp_lightning.runtime.activations import ActivationPolicy, UnitPolicy
from slidedp_lightning.runtime.engine import EngineConfig, HostGroups, SlideDPEngine

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

_START_METHODS = ("popen", "spawn", "fork", "forkserver")


def process_group_backend_for(device: torch.device, requested: Optional[str] = None) -> str:
    """The process group backend: on CUDA, NCCL for device tensors and gloo for the host tensors that the runtime
    also reduces (replicated route, deferred-update norms and flags, route and AutoPolicy probes, multi-host);
    on CPU, gloo. A requested backend without a CPU mapping gets gloo added for host tensors."""
    backend = requested or _get_default_process_group_backend_for_device(device)
    if device.type != "cuda" or "cpu:" in backend or backend == "gloo":
        return backend
    device_backend = backend.split(":")[-1]
    combined = f"cpu:gloo,cuda:{device_backend}"
    if requested:
        log.info("SlideDP: process group backend %r has no CPU mapping; using %r (the runtime also reduces host "
                 "tensors)", requested, combined)  # fmt: skip
    return combined


class SlideDPStrategy(ParallelStrategy):
    """Full-parameter training of models larger than device memory on the R devices of one host.

    One FP32 master copy of the weights and the Adam moments lives in host shared memory; units (embedding,
    decoder blocks, head) stream to each device just in time and each rank's CPU worker updates its 1/R
    shard of a unit as soon as that unit's gradient is reduced, overlapped with the rest of backward.

    Args:
        grad_route: ``"gpu_reduce"`` (reduce-scatter on the devices, 1x host traffic), ``"host_reduce"``
            (every rank copies its gradient to shared memory; owners sum inside the update) or ``"auto"``
            (measured at setup with all ranks at once; the numbers and the choice are logged).
        param_route: ``"full"``: every rank copies each whole unit host->device (R x host traffic);
            ``"sharded"``: every rank copies its 1/R shard, then the ranks all-gather the unit on the devices;
            ``"replicated"``: the SlideFormer-style multi-GPU baseline for benchmarks: every rank keeps and
            updates its own full ledger (R x host memory and CPU work), gradients all-reduced on the devices;
            ``"auto"``: ``full`` or ``sharded``, whichever the setup probe measures faster.
        prefetch_window: units resident at once in the streaming direction (>= 1).
        update_threads: CPU threads per rank for the update; default physical cores / local ranks.
        meta_init: run ``configure_model`` under the meta device: local rank 0 materializes and initializes
            one unit at a time straight into the ledger, so the model is never whole in memory.
        restore_module: after fit/validate, give the LightningModule ordinary FP32 CPU parameters again
            (copies of the master, on every rank); ``False`` leaves them on the meta device; ``"auto"`` restores
            when the copies fit in half of the available host memory.
        chunk_bytes: gradient path chunking (gpu_reduce, replicated): each chunk of a unit's reduced gradient goes
            to the CPU update as soon as it lands; ``None`` = one chunk per unit; ``"auto"`` = the smallest chunk
            whose reduce-scatter costs at most 10 % more per byte than whole units (measured).
        activation_policy: per decoder block, how activations are kept for backward: ``"none"``, ``"full"``
            (keep the block input, recompute the block), ``"segments:0101100"`` (keep the activations at the marked
            internal boundaries of the block, recompute the segments between them), ``"selective"`` (PyTorch's
            selective checkpointing, matmul outputs saved), each with an optional offload ratio ``"@0.5"`` (that
            fraction of the retained bytes waits in host memory between forward and backward); an
            :class:`~slidedp_lightning.runtime.activations.ActivationPolicy` with per-block overrides; ``"auto"``
            (AutoPolicy: measure every mode on a real block at the first training step and solve an integer
            program for the fastest plan within ``memory_budget``; the plan is saved as
            ``<default_root_dir>/slidedp_policy.json``), an :class:`~slidedp_lightning.autopolicy.AutoPolicy`, or
            the path of a saved plan/policy JSON (reused without measuring; its routes fill in ``"auto"`` routes).
        update: ``"immediate"``: each unit is updated as soon as its gradient (of the last micro-batch) lands;
            ``"deferred"``: gradients are kept in host memory until backward ends, then checked (a non-finite
            gradient skips the step on every rank), clipped by the exact global norm or by value, and applied
            (overlapping the next forward); ``"auto"``: deferred when clipping or 16-mixed needs it.
        checkpoint_format: ``"distributed"``: checkpoints are directories written by every rank through
            ``torch.distributed.checkpoint`` (FP32 weights and moments per parameter, loadable on any number of
            ranks, swapped into place atomically); ``"full"``: one ``torch.save`` file from rank 0.
        loss_chunk_tokens: compute a transformers causal LM's loss (``model(..., labels=...)``) this many tokens
            at a time: the head never holds the full ``[batch, seq, vocab]`` logits (long sequences, big vocabularies).
        max_units_in_flight: backward waits while this many units' gradients wait for the CPU update (bounds the
            gradient memory held for it, on the device under gpu_reduce).
        host_layout: with ``num_nodes > 1``: ``"replicated"`` (every host a full ledger, reduced gradient shards
            all-reduced between hosts) or ``"sharded"`` (every host 1/N of each unit's state: gradients
            reduce-scattered and parameters all-gathered over all ranks; needs ``param_route="sharded"`` and
            distributed checkpoints, which resume with either layout; no whole-parameter export).
        memory_budget: AutoPolicy's device memory budget: bytes, a fraction of the device's memory (CUDA), or
            None (90 % on CUDA, unlimited on CPU).
        trace_dir: record every lane operation; writes per-rank TensorBoard scalars (busy time per lane, exposed
            host time, overlap fraction), a Gantt figure of step 2 and ``trace_rank{r}.json`` (Chrome/Perfetto).
        start_method: ``"popen"`` (script launcher) or a multiprocessing start method.
        timeout: process-group timeout; also bounds every wait on another rank.
    """

    strategy_name = "slidedp"

    def __init__(
        self,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin: Optional[Precision] = None,
        *,
        grad_route: str = "gpu_reduce",
        param_route: str = "full",
        prefetch_window: int = 2,
        update_threads: Optional[int] = None,
        meta_init: bool = False,
        restore_module: Union[bool, str] = "auto",
        trace_dir: Optional[str] = None,
        chunk_bytes: Union[int, str, None] = None,
        activation_policy: Union[str, dict, ActivationPolicy, UnitPolicy, AutoPolicy, None] = None,
        memory_budget: Union[int, float, None] = None,
        update: str = "auto",
        checkpoint_format: str = "distributed",
        loss_chunk_tokens: Optional[int] = None,
        max_units_in_flight: int = 2,
        host_layout: str = "replicated",
        start_method: str = "popen",
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if restore_module not in (True, False, "auto"):
            raise ValueError(f"restore_module must be True, False or 'auto', got {restore_module!r}.")
        if start_method not in _START_METHODS:
            raise ValueError(f"start_method must be one of {_START_METHODS}, got {start_method!r}.")
        timeout = timeout or default_pg_timeout
        if update not in ("auto", "immediate", "deferred"):
            raise ValueError(f"update must be 'auto', 'immediate' or 'deferred', got {update!r}.")
        self._update = update
        if host_layout not in ("replicated", "sharded"):
            raise ValueError(f"host_layout must be 'replicated' or 'sharded', got {host_layout!r}.")
        if host_layout == "sharded" and param_route != "sharded":
            raise ValueError(f"host_layout='sharded' gathers every unit from all hosts: use param_route='sharded' "
                             f"(got {param_route!r}).")  # fmt: skip
        self.host_layout = host_layout
        if checkpoint_format not in ("distributed", "full"):
            raise ValueError(f"checkpoint_format must be 'distributed' or 'full', got {checkpoint_format!r}.")
        if host_layout == "sharded" and checkpoint_format == "full":
            raise ValueError("checkpoint_format='full' writes whole parameters from rank 0, and with "
                             "host_layout='sharded' no host holds them: use checkpoint_format='distributed' (each "
                             "host writes its share; it resumes with either layout).")  # fmt: skip
        self.checkpoint_format = checkpoint_format
        self._clip: tuple = (None, None)
        self.planner: Optional[AutoPolicy] = None
        if activation_policy == "auto":
            activation_policy = AutoPolicy(memory_budget=memory_budget)
        elif memory_budget is not None and not isinstance(activation_policy, AutoPolicy):
            raise ValueError(f"memory_budget={memory_budget!r} is AutoPolicy's budget: use it with "
                             "activation_policy='auto'.")  # fmt: skip
        if isinstance(activation_policy, AutoPolicy):
            self.planner, activation_policy = activation_policy, None
        elif isinstance(activation_policy, str) and activation_policy.endswith(".json"):
            param_route, grad_route, chunk_bytes = _plan_routes(activation_policy, param_route, grad_route, chunk_bytes)
        self.engine_config = EngineConfig(
            grad_route=grad_route,
            param_route=param_route,
            prefetch_window=prefetch_window,
            update_threads=update_threads,
            timeout_s=timeout.total_seconds(),
            trace_dir=trace_dir,
            chunk_bytes=chunk_bytes,
            activation_policy=ActivationPolicy.coerce(activation_policy),
            update="deferred" if update == "deferred" else "immediate",
            loss_chunk_tokens=loss_chunk_tokens,
            max_units_in_flight=max_units_in_flight,
        )
        self.meta_init = meta_init
        self.restore_module = restore_module
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1
        self.engine: Optional[SlideDPEngine] = None
        self._released_steps = 0  # optimizer steps of the last engine, whose state went with its ledger

    # -- registration --------------------------------------------------------------------------------
    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("slidedp", cls, description="SlideDP host-resident layer streaming")
        strategy_registry.register(
            "slidedp_spawn", cls, description="SlideDP, processes started with spawn", start_method="spawn"
        )

    # -- topology ------------------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        cfg = self.engine_config
        if num_nodes > 1 and (cfg.grad_route != "gpu_reduce" or "auto" in (cfg.param_route, cfg.chunk_bytes)
                              or cfg.param_route == "replicated"):  # fmt: skip
            raise ValueError(
                f"Across {num_nodes} nodes SlideDP reduces gradients on the devices and between the hosts, and every "
                "host must make the same choices: use grad_route='gpu_reduce' and an explicit param_route "
                f"('full' or 'sharded') and chunk_bytes (got {cfg.grad_route!r}, {cfg.param_route!r}, "
                f"{cfg.chunk_bytes!r})."
            )
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def precision_plugin(self) -> SlideDPPrecision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else SlideDPPrecision("32-true")

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
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
        rank_zero_only.rank = self.global_rank

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            if not self.cluster_environment.creates_processes_externally:
                self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = process_group_backend_for(self.root_device, self._process_group_backend)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)

    # -- setup ---------------------------------------------------------------------------------------
    def _check_trainer(self, trainer: "pl.Trainer") -> None:
        """Fit the engine to the Trainer: accumulation window, and deferred updates when clipping needs the
        global norm (or the precision needs unscaling and a finite check) before any update."""
        needs_deferred = bool(trainer.gradient_clip_val) or self.precision_plugin.scales_loss
        if self._update == "immediate" and needs_deferred:
            raise ValueError(
                "update='immediate' applies each unit's gradient as soon as it lands, before the global norm is "
                "known; gradient_clip_val and precision='16-mixed' need update='deferred' (or 'auto')."
            )
        update = "deferred" if self._update == "deferred" or needs_deferred else "immediate"
        self.engine_config = replace(self.engine_config, update=update, accumulate=trainer.accumulate_grad_batches)
        self._clip = (trainer.gradient_clip_val, trainer.gradient_clip_algorithm)

    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.model is not None and self.accelerator is not None
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_trainer(trainer)
        self.accelerator.setup(trainer)
        if self.planner is not None and self.planner.save_to is None:
            self.planner.save_to = os.path.join(trainer.default_root_dir, "slidedp_policy.json")
        if self.planner is not None and self.planner.plan is not None:
            # a later fit/validate of the same strategy reuses the plan instead of measuring again
            self.engine_config = replace(self.engine_config, activation_policy=self.planner.plan.activations)
        self.engine = SlideDPEngine(
            self.model,
            self.engine_config,
            device=self.root_device,
            compute_dtype=self.precision_plugin.compute_dtype,
            rank=self.global_rank,
            world_size=self.world_size,
            local_rank=self.local_rank,
            local_world_size=self.num_processes,
            group=_group.WORLD if self.world_size > 1 else None,
            planner=self.planner if self.planner is not None and self.planner.plan is None else None,
        ) if self.num_nodes == 1 else self._host_engine()
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ValueError(
                    f"SlideDP drives exactly one optimizer; configure_optimizers returned {len(self.optimizers)}."
                )
            self.engine.attach_optimizer(self.optimizers[0])
        self.setup_precision_plugin()

    def _host_engine(self) -> SlideDPEngine:
        """Several nodes: an engine over this host's ranks (its own ledger), joined to the other hosts."""
        n, size = self.num_nodes, self.num_processes
        locals_ = [dist.new_group(list(range(h * size, (h + 1) * size))) for h in range(n)]
        cross = [dist.new_group([h * size + r for h in range(n)]) for r in range(size)]
        leaders = dist.new_group([h * size for h in range(n)])
        if self.host_layout == "sharded":
            hosts = HostGroups(n, self.node_rank, self.global_rank, None, leaders if self.local_rank == 0 else None,
                               _group.WORLD, sharded=True, local=locals_[self.node_rank])  # fmt: skip
            return SlideDPEngine(
                self.model, self.engine_config, device=self.root_device,
                compute_dtype=self.precision_plugin.compute_dtype, rank=self.global_rank, world_size=self.world_size,
                local_rank=self.local_rank, local_world_size=size, group=_group.WORLD,
                planner=self.planner if self.planner is not None and self.planner.plan is None else None, hosts=hosts,
            )  # fmt: skip
        hosts = HostGroups(n, self.node_rank, self.global_rank, cross[self.local_rank],
                           leaders if self.local_rank == 0 else None, _group.WORLD)  # fmt: skip
        return SlideDPEngine(
            self.model, self.engine_config, device=self.root_device, compute_dtype=self.precision_plugin.compute_dtype,
            rank=self.local_rank, world_size=size, local_rank=self.local_rank, local_world_size=size,
            group=locals_[self.node_rank] if size > 1 else None,
            planner=self.planner if self.planner is not None and self.planner.plan is None else None, hosts=hosts,
        )  # fmt: skip

    def model_to_device(self) -> None:
        """Move buffers only: parameters are views into the engine's streamed device buffers."""
        assert self.model is not None
        for module in self.model.modules():
            for name, buf in module._buffers.items():
                if buf is not None and buf.device != self.root_device:
                    module._buffers[name] = buf.to(self.root_device)

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        # never the accelerator: the weights go to the host ledger, and only units visit the device
        with torch.device("meta" if empty_init else "cpu"):
            yield

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        if self.meta_init:
            with torch.device("meta"):
                yield
        else:
            yield

    # -- the step ------------------------------------------------------------------------------------
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        model = model or self.lightning_module
        result = self.precision_plugin.optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        assert self.engine is not None
        clip_val, algorithm = self._clip
        clip_norm = float(clip_val) if clip_val and algorithm != "value" else None
        clip_value = float(clip_val) if clip_val and algorithm == "value" else None
        stepped = self.engine.end_step(clip_norm, clip_value, self.precision_plugin.unscale_factor())
        self.precision_plugin.update_scale(found_inf=self.engine.skipped)
        if stepped:
            # the step ran on the CPU update lane, not in optimizer.step(); tell torch's LR schedulers it happened
            optimizer._opt_called = True
        return result

    # -- collectives ---------------------------------------------------------------------------------
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op="mean") -> Union[Tensor, Any]:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, name: Optional[str] = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    def broadcast(self, obj, src: int = 0):
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    # -- state ---------------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Full format: FP32 master weights from the ledger, on global rank 0 (the rank that writes the file).
        Distributed format: nothing here, the ranks write the ledger itself in ``save_checkpoint``."""
        if self.engine is None:
            return super().lightning_module_state_dict()
        if self.checkpoint_format == "distributed":
            return {}
        return self.engine.state_dict() if self.is_global_zero else {}

    def optimizer_state(self, optimizer) -> dict[str, Any]:
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

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        """Distributed format: a directory written by every rank through ``torch.distributed.checkpoint``,
        swapped into place atomically (see :mod:`slidedp_lightning.checkpoint`); full format: one file."""
        if self.engine is None or self.checkpoint_format == "full":
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError("SlideDP's distributed checkpoints do not use a CheckpointIO: drop storage_options, or "
                            "pass checkpoint_format='full'.")  # fmt: skip
        sharded.save(self.engine, checkpoint, filepath)

    def save_hf(self, directory, dtype: Union[str, torch.dtype] = torch.bfloat16, max_shard_size="5GB") -> None:
        """Write a Hugging Face ``save_pretrained`` directory (safetensors + config) straight from the ledger, in
        BF16 or FP32, without materializing the model; call it on every rank (rank 0 writes)."""
        if self.engine is None:
            raise RuntimeError("save_hf reads the host ledger, which exists only while the Trainer runs (fit or "
                               "validate): call it from a callback or use SaveHuggingFace.")  # fmt: skip
        export.save_hf(self.engine, directory, dtype, max_shard_size)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if self.engine is not None and sharded.is_sharded(checkpoint_path):
            meta = sharded.load(self.engine, checkpoint_path)
            return {**meta, "state_dict": {}, _LOADED: True}
        if sharded.is_sharded(checkpoint_path):
            raise ValueError(f"{checkpoint_path} is a SlideDP distributed checkpoint: load it with "
                             "Trainer(strategy=SlideDPStrategy(...)).fit(ckpt_path=...), which reads it into the "
                             "ledger.")  # fmt: skip
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.engine is not None
        if checkpoint.get(_LOADED):
            return  # read straight into the ledger by load_checkpoint
        self.engine.load_state_dict(checkpoint["state_dict"], strict=strict)

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

    # -- teardown ------------------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        if self.engine is not None:
            self.engine.abort()

    def teardown(self) -> None:
        if self.engine is not None:
            self._released_steps = self.engine.step
            self.engine.close(restore=self.restore_module)
            self.engine = None
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()


_LOADED = "_slidedp_loaded_into_ledger"


def _plan_routes(path: str, param_route: str, grad_route: str, chunk_bytes) -> tuple:
    """A saved AutoPolicy plan also fixes the routes it was planned for: they replace the "auto" arguments."""
    import json

    if not os.path.exists(path):
        raise FileNotFoundError(f"activation policy file {path} does not exist.")
    with open(path) as f:
        routes = json.load(f).get("routes", {})
    if param_route == "auto":
        param_route = routes.get("param_route", param_route)
    if grad_route == "auto":
        grad_route = routes.get("grad_route", grad_route)
    if chunk_bytes == "auto":
        chunk_bytes = routes.get("chunk_bytes", chunk_bytes)
    return param_route, grad_route, chunk_bytes
