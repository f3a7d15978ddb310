"""``SlideDPStrategy``: the thin Lightning adapter around :class:`~slidedp_lightning.runtime.engine.SlideDPEngine`."""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from slidedp_lightning import constants
from slidedp_lightning.callbacks import LaneTrace
from slidedp_lightning.checkpoints import distributed as sharded
from slidedp_lightning.checkpoints.full import save_full
from slidedp_lightning.checks import refuse_what_cannot_see_gradients
from slidedp_lightning.constants import CheckpointFormat, GradRoute, HostLayout, OptimizerState, ParamRoute, UpdateMode
from slidedp_lightning.hf import export
from slidedp_lightning.lifecycle import SlideDPLifecycle, StartMethod
from slidedp_lightning.options import ActivationOption, SlideDPOptions, StateOnDisk
from slidedp_lightning.precision import SlideDPPrecision, slidedp_precision
from slidedp_lightning.process import requeue
from slidedp_lightning.process.launcher import TrainerScriptLauncher

if TYPE_CHECKING:
    import lightning.pytorch as pl

_LOADED = "_slidedp_loaded_into_ledger"


def _all_reduce(tensor: Tensor, group: Any | None, reduce_op: Any) -> Tensor:
    """``tensor`` reduced in place over ``group`` (None: every rank) by ``reduce_op``: a ``ReduceOp``, None (sum) or
    its name; "mean"/"avg" sum and divide, as gloo has no average."""
    name = reduce_op.lower() if isinstance(reduce_op, str) else None
    mean = name in ("mean", "avg")
    op = reduce_op
    if mean or reduce_op is None:
        op = dist.ReduceOp.SUM
    elif name is not None:
        op = getattr(dist.ReduceOp, name.upper())
    dist.all_reduce(tensor, op=op, group=group)
    if not mean:
        return tensor
    world = dist.get_world_size(group)
    return tensor.div_(world) if tensor.is_floating_point() else tensor.copy_(tensor / world)


class SlideDPStrategy(SlideDPLifecycle, ParallelStrategy):
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

    strategy_name = constants.STRATEGY_NAME
    script_launcher = TrainerScriptLauncher

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
        optimizer_state: OptimizerState | StateOnDisk = "fp32",
        bf16_copy: bool = True,
        start_method: StartMethod = "popen",
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__()
        # every argument but start_method and timeout is an option, checked by SlideDPOptions
        options = SlideDPOptions(
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
        self._init_lifecycle(options, start_method, timeout)
        self._clip: tuple[float | None, str | None] = (None, None)

    # -- ranks, devices and the process group: SlideDPLifecycle --------------------------------------
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
        self._precision_plugin = slidedp_precision(plugin, SlideDPPrecision, "Trainer")

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            if self._name_launcher():
                self._launcher = self.script_launcher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self._join_process_group()

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
        self._build_engine(self.model, config, self.precision_plugin.compute_dtype, trainer.default_root_dir)
        assert self.engine is not None
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
        self._move_buffers(self.model)

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        with self._host_device(empty_init):
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        with self._ledger_context():
            yield

    # -- the step ------------------------------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        model = model or self.lightning_module
        result = self.precision_plugin.optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        clip_val, algorithm = self._clip
        clip_norm = float(clip_val) if clip_val and algorithm != "value" else None
        clip_value = float(clip_val) if clip_val and algorithm == "value" else None
        self._end_step(optimizer, clip_norm, clip_value, self.precision_plugin)
        return result

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        if self.engine is not None:  # the lane trace names the loss and the training step apart from the closure
            self.engine.trace_phase("loss, training step", "closure, backward to the first unit")
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._loop_span("validation step"):
            return super().validation_step(*args, **kwargs)

    def _loop_span(self, name: str) -> Any:
        """A lane-trace span of the compute thread outside the units (a no-op without tracing)."""
        engine = self.engine
        return engine.tracer.span("loop", name, engine.step) if engine is not None else nullcontext()

    # -- collectives ---------------------------------------------------------------------------------
    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        """Reduce ``tensor`` over the ranks in place (``self.log(..., sync_dist=True)`` calls this): one all-reduce,
        without the barrier Lightning's DDP helper runs before it (the all-reduce itself waits for every rank)."""
        if isinstance(tensor, Tensor) and dist.is_available() and dist.is_initialized():
            with self._loop_span("all_reduce of a logged value"):
                return _all_reduce(tensor, group, reduce_op)
        return tensor

    @override
    def barrier(self, name: str | None = None) -> None:
        SlideDPLifecycle.barrier(self, name)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return SlideDPLifecycle.broadcast(self, obj, src)

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
        no such form is refused; see :mod:`slidedp_lightning.checkpoints.distributed`); full format: one file."""
        if self.engine is None or self.checkpoint_format == "full":
            if self.is_global_zero:  # atomically, a full disk named: slidedp_lightning.checkpoints.full
                save_full(self.checkpoint_io, checkpoint, filepath, storage_options)
            return None
        sharded.refuse_storage_options(storage_options)
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

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._fail(exception)

    @override
    def teardown(self) -> None:
        """Close the engine, then destroy the process groups of the run: the runtime's own groups, and the default
        group when this strategy created it (at the very end), so that no collective backend's thread is left to
        interpreter shutdown. After a failure the groups are left to the process's exit (see
        :func:`~slidedp_lightning.process.groups.destroy_default_group`). What happens to the rank processes this one
        launched when it exits: :class:`~slidedp_lightning.process.signals.LaunchedAtExit`."""
        self._close_engine()
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        self._end_run()
