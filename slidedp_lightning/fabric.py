"""``SlideDPFabricStrategy``: ``Fabric(strategy="slidedp")``, the second thin adapter around the SlideDP engine.

Everything but what Fabric's API differs in is shared with the Trainer's strategy through
:class:`~slidedp_lightning.lifecycle.SlideDPLifecycle` (options, process group, Topology, engine, step, signals,
teardown), :mod:`slidedp_lightning.precision` (:class:`~slidedp_lightning.precision.LossScaling`) and
:mod:`slidedp_lightning.checkpoints.distributed` (the distributed checkpoint format).
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import sys
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.types import _PATH
from torch import Tensor, nn
from torch.optim import Optimizer

from slidedp_lightning.checkpoints import distributed as sharded
from slidedp_lightning.checkpoints import fabric as fabric_checkpoints
from slidedp_lightning.lifecycle import SlideDPLifecycle, StartMethod
from slidedp_lightning.options import SlideDPOptions
from slidedp_lightning.precision import SlideDPFabricPrecision, slidedp_precision
from slidedp_lightning.process.launcher import FabricScriptLauncher

log = logging.getLogger(__name__)


class SlideDPFabricStrategy(SlideDPLifecycle, ParallelStrategy):
    """SlideDP under Lightning Fabric: one model and one ``torch.optim.Adam``/``AdamW`` per process, their FP32
    master weights and moments in the host ledger, the update on the CPU as gradients land.

    Args: the options of :class:`~slidedp_lightning.options.SlideDPOptions` as keywords (``update="auto"`` means
        ``"deferred"`` here: Fabric learns of clipping only at ``fabric.clip_gradients``), and
        accumulate_grad_batches: backward passes summed (in host memory) per ``optimizer.step()``; with it above
            1, ``fabric.no_backward_sync(model, enabled=...)`` is accepted (the engine reduces as it goes);
        start_method: ``"popen"`` (``fabric.launch()`` re-runs the script) or a multiprocessing start method;
        timeout: process-group timeout; also bounds every wait on another rank.

    ``optimizer.step()`` closes the step (the deferred update is clipped and applied then), ``fabric.clip_gradients``
    closes it early to return the exact global norm; :attr:`last_grad_norm` holds the last one. The ledger lives
    until :meth:`teardown` (called at the process's exit if the script does not).
    """

    script_launcher = FabricScriptLauncher

    def __init__(
        self,
        *,
        accumulate_grad_batches: int = 1,
        start_method: StartMethod = "popen",
        timeout: timedelta | None = default_pg_timeout,
        **options: Any,
    ) -> None:
        super().__init__()
        self._init_lifecycle(SlideDPOptions(**options), start_method, timeout)
        if not isinstance(accumulate_grad_batches, int) or accumulate_grad_batches < 1:
            raise ValueError(f"accumulate_grad_batches must be an integer >= 1, got {accumulate_grad_batches!r}.")
        self._accumulate = accumulate_grad_batches
        self._backward_sync_control = _AccumulateInHost(accumulate_grad_batches)
        self.model: nn.Module | None = None
        self.optimizer: Optimizer | None = None
        self._closed_by_clip = False  # clip_gradients closed this step; optimizer.step() only marks it
        self._at_exit = False

    # -- precision, ranks, launch --------------------------------------------------------------------
    @property
    def precision(self) -> SlideDPFabricPrecision:
        plugin = self._precision
        return plugin if isinstance(plugin, SlideDPFabricPrecision) else SlideDPFabricPrecision("32-true")

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        self._precision = slidedp_precision(precision, SlideDPFabricPrecision, "Fabric")

    def _set_world_ranks(self) -> None:  # Fabric's connector sets _num_nodes, then calls this
        self.options.check_nodes(self._num_nodes)
        self.set_world_ranks()

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            if self._name_launcher():
                self._launcher = self.script_launcher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _ClosingLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        super().setup_environment()
        self._join_process_group()

    # -- the model and the optimizer -----------------------------------------------------------------
    @contextmanager
    def module_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``fabric.init_module()``: on the host (``empty_init=True`` or ``meta_init``: the meta device, the
        engine initializes one unit at a time); ``slidedp_lightning.from_pretrained`` reads into the ledger."""
        with self.precision.module_init_context(), self._host_device(empty_init), self._ledger_context():
            yield

    def tensor_init_context(self) -> AbstractContextManager:
        return self._host_device(False)

    def module_to_device(self, module: nn.Module) -> None:
        """Buffers only, once the engine exists (parameters are views of its streamed buffers)."""
        if self.engine is not None:
            self._move_buffers(module)

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any | None]:
        """``fabric.setup(model, optimizer)``: the optimizer may hold the model's parameters from before the engine
        replaced them; its param groups are remapped to the new ones by name."""
        if len(optimizers) != 1:
            raise ValueError(
                f"SlideDP drives exactly one optimizer (one torch.optim.AdamW/Adam over all trainable parameters, "
                f"with param groups for different hyper-parameters); fabric.setup got {len(optimizers)}."
            )
        self._setup_model(module, optimizers[0])
        return module, optimizers, scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        self._setup_model(module, None)
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """``fabric.setup_optimizers(optimizer)`` after ``fabric.setup_module(model)``."""
        if self.engine is None or self.model is None:
            raise RuntimeError(
                "SlideDP: set up the model before the optimizer: model = fabric.setup_module(model), then "
                "fabric.setup_optimizers(torch.optim.AdamW(model.parameters())), or fabric.setup(model, optimizer)."
            )
        self._attach(optimizer, self._names_by_group(optimizer, _param_names(self.model)))
        return optimizer

    def _setup_model(self, module: nn.Module, optimizer: Optimizer | None) -> None:
        if self.engine is not None or self.model is not None:
            raise ValueError(
                "SlideDP streams one model per process and it is set up already: fabric.setup/setup_module takes "
                "that one model once (build several parts as submodules of one nn.Module)."
            )
        names = None
        if optimizer is not None:  # by name: the engine replaces every parameter by a view of a streamed buffer
            names = self._names_by_group(optimizer, _param_names(module))
            for group in optimizer.param_groups:
                group["params"] = []  # no reference keeps the original weights alive beside the ledger
        config = self.options.engine_config(
            clipping=self.options.update != "immediate",  # "auto": deferred, so that clip_gradients can come
            scales_loss=self.precision.scales_loss,
            accumulate=self._accumulate,
            timeout_s=self._timeout.total_seconds(),
            trace_dir=None,
        )
        assert self.accelerator is not None
        try:
            self._build_engine(module, config, self.precision.compute_dtype, os.getcwd())
        except BaseException:
            if optimizer is not None and names is not None:  # what the model holds now, after the engine unwound
                _remap(optimizer, names, dict(module.named_parameters(remove_duplicate=False)))
            raise
        self.model = module
        self._move_buffers(module)
        if optimizer is not None and names is not None:
            self._attach(optimizer, names)
        self._signals.install()
        if not self._at_exit:
            atexit.register(self._teardown_at_exit)
            self._at_exit = True

    @staticmethod
    def _names_by_group(optimizer: Optimizer, names: dict[int, str]) -> list[list[str]]:
        """The parameter names of each param group; refuses an optimizer that has stepped or holds a tensor that is
        not one of the model's parameters."""
        if any(optimizer.state.values()):
            raise ValueError(
                f"SlideDP: the {type(optimizer).__name__} passed to Fabric already has state (it stepped before "
                "setup); SlideDP keeps the Adam moments in the host ledger and cannot take them over. Create the "
                "optimizer afresh for fabric.setup, or restore its state afterwards with fabric.load."
            )
        out = []
        for i, group in enumerate(optimizer.param_groups):
            unknown = [tuple(p.shape) for p in group["params"] if id(p) not in names]
            if unknown:
                raise ValueError(
                    f"SlideDP: param group {i} of the optimizer holds {len(unknown)} tensor(s) that are not "
                    f"parameters of the model being set up (shapes {unknown[:3]}); build the optimizer from "
                    "model.parameters() of that model."
                )
            out.append([names[id(p)] for p in group["params"]])
        return out

    def _attach(self, optimizer: Optimizer, names: list[list[str]]) -> None:
        assert self.engine is not None and self.model is not None
        if self.optimizer is not None and optimizer is not self.optimizer:
            raise ValueError(
                "SlideDP drives exactly one optimizer and one is set up already; put every trainable parameter in "
                "that one (param groups for different hyper-parameters)."
            )
        _remap(optimizer, names, dict(self.model.named_parameters(remove_duplicate=False)))
        self.engine.attach_optimizer(optimizer)
        self.optimizer = optimizer

    # -- the step ------------------------------------------------------------------------------------
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        if self._closed_by_clip:
            raise RuntimeError(
                "SlideDP: fabric.clip_gradients closed this optimizer step (it applied the clipped update to "
                "return the global norm); call optimizer.step() next, before the next backward."
            )
        super().backward(tensor, module, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``optimizer.step()``: no torch step; the engine's update ran on the CPU as the gradients landed (or,
        deferred, runs now). A closure, if given, runs first (forward and backward)."""
        closure: Callable[[], Any] | None = kwargs.pop("closure", None)
        result = closure() if closure is not None else None
        self._check_optimizer(optimizer)
        if self._closed_by_clip:
            self._closed_by_clip = False
        else:
            self._end_step(optimizer, None, None, self.precision)
        return result

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the exact global L2 norm: closes the step now (the engine computes the norm over every rank's
        shards, clips and applies the update) and returns that norm, before clipping, as torch does."""
        if float(norm_type) != 2.0:
            raise ValueError(
                f"SlideDP clips by the exact global L2 norm of the gradient; norm_type={norm_type!r} is not "
                "implemented: use norm_type=2.0, or clip_val=... to clip by value."
            )
        self._clip_now(optimizer, float(max_norm), None, "max_norm")
        norm = self.last_grad_norm if self.last_grad_norm is not None else float("nan")
        if error_if_nonfinite and not math.isfinite(norm):
            raise RuntimeError(
                f"The total norm of order 2.0 for gradients is non-finite ({norm}), so it cannot be clipped; SlideDP "
                "skipped this step on every rank (weights and moments untouched). Pass error_if_nonfinite=False to "
                "go on skipping such steps."
            )
        return torch.tensor(norm, dtype=torch.float32)  # as torch.nn.utils.clip_grad_norm_ returns it

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Clamp every gradient element to ``[-clip_val, clip_val]``: closes the step now, as clipping by norm."""
        self._clip_now(optimizer, None, float(clip_val), "clip_val")

    def _clip_now(self, optimizer: Any, clip_norm: float | None, clip_value: float | None, flag: str) -> None:
        self._check_optimizer(optimizer)
        assert self.engine is not None
        if self.engine.config.update != "deferred":
            raise RuntimeError(
                f"fabric.clip_gradients({flag}=...) needs the whole step's gradient before any update, and this "
                "SlideDPFabricStrategy was built with update='immediate' (each unit is updated as soon as its "
                "gradient lands): use update='deferred' or 'auto'."
            )
        if self._closed_by_clip:
            raise RuntimeError("SlideDP: fabric.clip_gradients was called twice in one step; call optimizer.step().")
        self._end_step(optimizer, clip_norm, clip_value, self.precision)
        self._closed_by_clip = True

    def _check_optimizer(self, optimizer: Any) -> None:
        if self.engine is None or self.optimizer is None:
            raise RuntimeError("SlideDP: no optimizer is set up; call fabric.setup(model, optimizer) first.")
        if getattr(optimizer, "optimizer", optimizer) is not self.optimizer:
            raise ValueError("SlideDP drives exactly one optimizer: this is not the one set up with Fabric.")

    # -- collectives ---------------------------------------------------------------------------------
    def all_reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, name: str | None = None) -> None:
        SlideDPLifecycle.barrier(self, name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return SlideDPLifecycle.broadcast(self, obj, src)

    # -- checkpoints (slidedp_lightning.checkpoints.fabric) ----------------------------------------------
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """``fabric.save`` (:func:`~slidedp_lightning.checkpoints.fabric.save`)."""
        if self.engine is None:
            return super().save_checkpoint(path, state, storage_options, filter)
        fabric_checkpoints.save(self, path, state, storage_options, filter)
        return None

    def load_checkpoint(
        self,
        path: _PATH,
        state: nn.Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """``fabric.load`` (:func:`~slidedp_lightning.checkpoints.fabric.load`)."""
        if not sharded.is_sharded(path) and (self.engine is None or not state):
            return super().load_checkpoint(path, state, strict, True if weights_only is None else weights_only)
        return fabric_checkpoints.load(self, path, state, strict, weights_only)

    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        if self.engine is not None and module is self.model:
            return self.engine.state_dict() if self.is_global_zero else {}
        return super().get_module_state_dict(module)

    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        if self.engine is not None and module is self.model:
            self.engine.load_state_dict(state_dict, strict=strict)
            return
        super().load_module_state_dict(module, state_dict, strict)

    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self.engine is not None and optimizer is self.optimizer:
            return self.engine.optimizer_state_dict(optimizer) if self.is_global_zero else {}
        return super().get_optimizer_state(optimizer)

    # -- teardown ------------------------------------------------------------------------------------
    def teardown(self) -> None:
        """Close the engine (the model gets FP32 CPU parameters back when they fit, see
        :meth:`SlideDPEngine.close`) and destroy the process groups of the run. Fabric calls no teardown: call
        ``fabric.strategy.teardown()`` at the end of the script, or it runs at the process's exit."""
        if self._at_exit:
            atexit.unregister(self._teardown_at_exit)
            self._at_exit = False
        self._close_engine()
        self.precision.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        self.model = self.optimizer = None
        self._closed_by_clip = False
        self._end_run()

    def _teardown_at_exit(self) -> None:
        """At exit after an unhandled exception or a signal, wait on no other rank (they may be gone)."""
        error = getattr(sys, "last_value", None)
        if isinstance(error, BaseException) or self._signals._state == "stopping":
            self._fail(error if isinstance(error, BaseException) else SystemExit())
        try:
            self.teardown()
        except Exception as err:  # the process is ending: say it, do not mask the exit status it has
            log.error("SlideDP: teardown at exit failed on rank %d: %s", self.global_rank, err)


class _AccumulateInHost(_BackwardSyncControl):
    """``fabric.no_backward_sync``: the engine reduces each unit's gradient as it is produced and sums the micro-
    batches in host memory, so skipping the reduction is not a mode it has; with ``accumulate_grad_batches > 1``
    the context is accepted (the result is the same), else refused."""

    def __init__(self, accumulate: int) -> None:
        self.accumulate = accumulate

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if enabled and self.accumulate == 1:
            raise ValueError(
                "fabric.no_backward_sync(model, enabled=True): SlideDP does not keep unreduced gradients on the "
                "device; it reduces each unit's gradient as it is produced and accumulates micro-batches in host "
                "memory. Pass SlideDPFabricStrategy(accumulate_grad_batches=N) (backward passes per "
                "optimizer.step()); no_backward_sync is then accepted and changes nothing."
            )
        return nullcontext()


class _ClosingLauncher(_MultiProcessingLauncher):
    """Fabric's multiprocessing launcher, whose worker processes tear the strategy down when the function returns
    (they end with ``os._exit``: no exit handler runs there)."""

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        try:
            super()._wrapping_function(*args, **kwargs)
        except BaseException as err:
            strategy = self._strategy
            if isinstance(strategy, SlideDPFabricStrategy):
                strategy._fail(err)
            raise
        finally:
            if isinstance(self._strategy, SlideDPFabricStrategy):
                self._strategy.teardown()


def _param_names(module: nn.Module) -> dict[int, str]:
    """id -> name of every parameter of ``module`` (a tied one: its first name)."""
    names: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def _remap(optimizer: Optimizer, names: list[list[str]], params: dict[str, nn.Parameter]) -> None:
    for group, group_names in zip(optimizer.param_groups, names):
        group["params"] = [params[n] for n in group_names]
