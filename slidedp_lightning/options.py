"""The strategy's options and every rule that combines them, checked in one place.

:class:`SlideDPOptions` is what a user passes to :class:`~slidedp_lightning.SlideDPStrategy`; its checks run at
construction (each option alone and the pairs that exclude each other), when the number of nodes is known
(:meth:`SlideDPOptions.check_nodes`) and when the Trainer's flags are known (:meth:`SlideDPOptions.engine_config`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Literal

from slidedp_lightning.autopolicy import AutoPolicy
from slidedp_lightning.constants import (
    CHECKPOINT_FORMATS,
    HOST_LAYOUTS,
    OPTIMIZER_STATES,
    CheckpointFormat,
    GradRoute,
    HostLayout,
    OptimizerState,
    ParamRoute,
    UpdateMode,
)
from slidedp_lightning.runtime.activation_policy import ActivationPolicy, UnitPolicy
from slidedp_lightning.runtime.config import EngineConfig

ActivationOption = str | dict | ActivationPolicy | UnitPolicy | AutoPolicy | None


@dataclass(frozen=True)
class StateOnDisk:
    """``optimizer_state=StateOnDisk(directory)``: the Adam moments (``moments``: ``"fp32"`` or ``"int8"``) live in
    one file on a local disk in ``directory``, shared by the host's ranks, instead of host memory (8 B/param less
    with FP32 moments); each rank's CPU update reads its shard of the next units ahead and writes them back behind
    (direct I/O where the filesystem allows). With ``master=True`` the FP32 master weights live there too (4 B/param
    less again): host memory keeps only the BF16 copy the devices read, so this needs bf16 compute
    (``precision="bf16-mixed"`` or ``"bf16-true"``) with ``bf16_copy=True``. The file is unnamed: it is gone when the
    job ends, however it ends. The directory's free space is checked at setup. See docs/ledger.md, "State on a local
    disk"."""

    directory: str
    moments: OptimizerState = "fp32"
    master: bool = False

    def __post_init__(self) -> None:
        if self.moments not in OPTIMIZER_STATES:
            raise ValueError(f"StateOnDisk moments must be one of {OPTIMIZER_STATES}, got {self.moments!r}.")
        if not isinstance(self.master, bool):
            raise ValueError(f"StateOnDisk master must be True or False, got {self.master!r}.")
        if not isinstance(self.directory, (str, os.PathLike)) or not str(self.directory):
            raise ValueError(f"StateOnDisk needs a directory on a local disk, got {self.directory!r}.")
        if not os.path.isdir(self.directory):
            raise FileNotFoundError(
                f"StateOnDisk directory {self.directory!r} does not exist: create it on a local disk (an NVMe SSD "
                "for speed) that every rank of the host can reach."
            )
        object.__setattr__(self, "directory", os.path.abspath(os.fspath(self.directory)))


@dataclass(frozen=True)
class SlideDPOptions:
    """The user's choices for :class:`~slidedp_lightning.SlideDPStrategy`.

    Args:
        param_route: ``"full"``: every rank copies each whole unit host->device (R x host traffic);
            ``"sharded"``: every rank copies its 1/R shard, then the ranks all-gather the unit on the devices;
            ``"replicated"``: the SlideFormer-style multi-GPU baseline for benchmarks: every rank keeps and
            updates its own full ledger (R x host memory and CPU work), gradients all-reduced on the devices;
            ``"auto"``: ``full`` or ``sharded``, whichever the setup probe measures faster.
        grad_route: ``"gpu_reduce"`` (reduce-scatter on the devices, 1x host traffic), ``"host_reduce"``
            (every rank copies its gradient to shared memory; owners sum inside the update) or ``"auto"``
            (measured at setup with all ranks at once; the numbers and the choice are logged).
        chunk_bytes: gradient path chunking (gpu_reduce, replicated): each chunk of a unit's reduced gradient goes
            to the CPU update as soon as it lands; ``None`` = one chunk per unit; ``"auto"`` = the smallest chunk
            whose reduce-scatter costs at most 10 % more per byte than whole units (measured).
        prefetch_window: units resident at once in the streaming direction (>= 1).
        max_units_in_flight: backward waits while this many units' gradients wait for the CPU update (bounds the
            gradient memory held for it, on the device under gpu_reduce).
        update_threads: CPU threads per rank for the update; default physical cores / local ranks.
        activation_policy: per decoder block, how activations are kept for backward: ``"none"``, ``"full"``
            (keep the block input, recompute the block), ``"segments:0101100"`` (keep the activations at the marked
            internal boundaries of the block, recompute the segments between them), ``"selective"`` (PyTorch's
            selective checkpointing, matmul outputs saved), each with an optional offload ratio ``"@0.5"`` (that
            fraction of the retained bytes waits in host memory between forward and backward); an
            :class:`~slidedp_lightning.runtime.activation_policy.ActivationPolicy` with per-block overrides; ``"auto"`` or
            an :class:`~slidedp_lightning.autopolicy.AutoPolicy` (with its ``memory_budget``): measure every mode
            on a real block at the first training step and solve an integer program for the fastest plan, saved as
            ``<default_root_dir>/slidedp_policy.json``; or the path of a saved plan (reused without measuring; its
            routes fill in ``"auto"`` routes).
        update: ``"immediate"``: each unit is updated as soon as its gradient (of the last micro-batch) lands;
            ``"deferred"``: gradients are kept in host memory until backward ends, then checked (a non-finite
            gradient skips the step on every rank), clipped by the exact global norm or by value, and applied
            (overlapping the next forward); ``"auto"``: deferred when clipping or 16-mixed needs it.
        meta_init: run ``configure_model`` under the meta device: local rank 0 materializes and initializes
            one unit at a time straight into the ledger, so the model is never whole in memory.
        host_layout: with ``num_nodes > 1``: ``"replicated"`` (every host a full ledger, reduced gradient shards
            all-reduced between hosts) or ``"sharded"`` (every host 1/N of each unit's state: gradients
            reduce-scattered and parameters all-gathered over all ranks; needs ``param_route="sharded"`` and
            distributed checkpoints, which resume with either layout; no whole-parameter export).
        checkpoint_format: ``"distributed"``: checkpoints are directories written by every rank through
            ``torch.distributed.checkpoint`` (FP32 weights and moments per parameter, loadable on any number of
            ranks, swapped into place atomically); ``"full"``: one ``torch.save`` file from rank 0.
        optimizer_state: the ledger's Adam moments, ``"fp32"`` (exact) or ``"int8"`` (block-wise 8-bit, 8 B/param
            ledger), in host memory; or :class:`StateOnDisk` for moments (and the master) in a file on a local disk; bf16_copy: keep the BF16 transfer copy (False: converted from the master on the way, -2 B/param).
    """

    param_route: ParamRoute | Literal["auto"] = "full"
    grad_route: GradRoute | Literal["auto"] = "gpu_reduce"
    chunk_bytes: int | Literal["auto"] | None = None
    prefetch_window: int = 2
    max_units_in_flight: int = 2
    update_threads: int | None = None
    activation_policy: ActivationOption = None
    update: UpdateMode | Literal["auto"] = "auto"
    meta_init: bool = False
    host_layout: HostLayout = "replicated"
    checkpoint_format: CheckpointFormat = "distributed"
    optimizer_state: OptimizerState | StateOnDisk = "fp32"
    bf16_copy: bool = True

    @property
    def moments(self) -> str:
        """The Adam moments' form, "fp32" or "int8" (wherever they live)."""
        state = self.optimizer_state
        return state.moments if isinstance(state, StateOnDisk) else state

    @property
    def state_dir(self) -> str | None:
        """The directory of the state file on disk (None: the moments are in host memory)."""
        return self.optimizer_state.directory if isinstance(self.optimizer_state, StateOnDisk) else None

    @property
    def master_on_disk(self) -> bool:
        """Whether the FP32 master weights live in the state file on disk too."""
        return isinstance(self.optimizer_state, StateOnDisk) and self.optimizer_state.master

    def __post_init__(self) -> None:
        if isinstance(self.optimizer_state, StateOnDisk):
            if self.checkpoint_format == "full":
                raise ValueError(
                    "checkpoint_format='full' gathers every moment into one file on rank 0; with the moments on disk "
                    "(StateOnDisk) use checkpoint_format='distributed'."
                )
        elif self.optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(
                f"optimizer_state must be one of {OPTIMIZER_STATES} (the Adam moments in the host ledger: exact FP32 "
                f"or block-wise 8-bit), got {self.optimizer_state!r}."
            )
        if not isinstance(self.bf16_copy, bool):
            raise ValueError(f"bf16_copy must be True or False, got {self.bf16_copy!r}.")
        if self.master_on_disk and not self.bf16_copy:
            raise ValueError(
                "StateOnDisk(master=True) keeps the FP32 master on disk and only the BF16 copy in host memory for the "
                "devices to read; bf16_copy=False would have them read the master: keep bf16_copy=True, or keep the "
                "master in memory (StateOnDisk(master=False))."
            )
        if self.moments == "int8" and self.checkpoint_format == "full":
            raise ValueError(
                "checkpoint_format='full' stores torch AdamW's FP32 moments, and optimizer_state='int8' keeps 8-bit "
                "ones: use checkpoint_format='distributed' (it stores the 8-bit moments as the ledger holds them) or "
                "optimizer_state='fp32'."
            )
        if self.update not in ("auto", "immediate", "deferred"):
            raise ValueError(f"update must be 'auto', 'immediate' or 'deferred', got {self.update!r}.")
        if self.host_layout not in HOST_LAYOUTS:
            raise ValueError(f"host_layout must be one of {HOST_LAYOUTS}, got {self.host_layout!r}.")
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint_format must be one of {CHECKPOINT_FORMATS}, got {self.checkpoint_format!r}.")
        if not isinstance(self.meta_init, bool):
            raise ValueError(f"meta_init must be True or False, got {self.meta_init!r}.")
        if self.host_layout == "sharded" and self.param_route != "sharded":
            raise ValueError(
                "host_layout='sharded' gathers every unit from all hosts: use param_route='sharded' "
                f"(got {self.param_route!r})."
            )
        if self.host_layout == "sharded" and self.checkpoint_format == "full":
            raise ValueError(
                "checkpoint_format='full' writes whole parameters from rank 0, and with host_layout='sharded' no "
                "host holds them: use checkpoint_format='distributed' (each host writes its share; it resumes with "
                "either layout)."
            )
        self.base_engine_config()  # routes, sizes and the activation policy, checked by the engine's own rules

    # -- derived ------------------------------------------------------------------------------------------
    @property
    def planner(self) -> AutoPolicy | None:
        """AutoPolicy, when it chooses the activation policy (``activation_policy="auto"`` or an instance)."""
        if self.activation_policy == "auto":
            return None  # made once by the strategy, which keeps its plan across fits
        return self.activation_policy if isinstance(self.activation_policy, AutoPolicy) else None

    def _routes(self) -> tuple[str, str, int | str | None]:
        """The routes, with a saved AutoPolicy plan's routes filling in "auto" ones."""
        policy = self.activation_policy
        if isinstance(policy, str) and policy.endswith(".json"):
            return _plan_routes(policy, self.param_route, self.grad_route, self.chunk_bytes)
        return self.param_route, self.grad_route, self.chunk_bytes

    def base_engine_config(self) -> EngineConfig:
        """The engine config before the Trainer is known (no accumulation, immediate updates, no planner)."""
        param_route, grad_route, chunk_bytes = self._routes()
        policy = self.activation_policy
        static = None if policy == "auto" or isinstance(policy, AutoPolicy) else policy
        return EngineConfig(
            grad_route=grad_route,
            param_route=param_route,
            prefetch_window=self.prefetch_window,
            update_threads=self.update_threads,
            chunk_bytes=chunk_bytes,
            activation_policy=ActivationPolicy.coerce(static),
            update="deferred" if self.update == "deferred" else "immediate",
            max_units_in_flight=self.max_units_in_flight,
            optimizer_state=self.moments,
            state_dir=self.state_dir,
            master_on_disk=self.master_on_disk,
            bf16_copy=self.bf16_copy,
        )

    # -- rules that need the job --------------------------------------------------------------------------
    def check_nodes(self, num_nodes: int) -> None:
        """Across several nodes gradients are reduced on the devices and between hosts, the same way everywhere."""
        cfg = self.base_engine_config()
        explicit = "auto" not in (cfg.param_route, cfg.chunk_bytes) and cfg.param_route != "replicated"
        if num_nodes > 1 and (cfg.grad_route != "gpu_reduce" or not explicit):
            raise ValueError(
                f"Across {num_nodes} nodes SlideDP reduces gradients on the devices and between the hosts, and every "
                "host must make the same choices: use grad_route='gpu_reduce' and an explicit param_route "
                f"('full' or 'sharded') and chunk_bytes (got {cfg.grad_route!r}, {cfg.param_route!r}, "
                f"{cfg.chunk_bytes!r})."
            )

    def engine_config(
        self, *, clipping: bool, scales_loss: bool, accumulate: int, timeout_s: float, trace_dir: str | None
    ) -> EngineConfig:
        """The engine config for one fit: deferred updates when clipping needs the global norm (or the precision
        needs unscaling and a finite check) before any update; the Trainer's accumulation window."""
        needs_deferred = clipping or scales_loss
        if self.update == "immediate" and needs_deferred:
            raise ValueError(
                "update='immediate' applies each unit's gradient as soon as it lands, before the global norm is "
                "known; gradient_clip_val and precision='16-mixed' need update='deferred' (or 'auto')."
            )
        update = "deferred" if self.update == "deferred" or needs_deferred else "immediate"
        return replace(
            self.base_engine_config(), update=update, accumulate=accumulate, timeout_s=timeout_s, trace_dir=trace_dir
        )


def _plan_routes(path: str, param_route: str, grad_route: str, chunk_bytes: int | str | None) -> tuple:
    """A saved AutoPolicy plan also fixes the routes it was planned for: they replace the "auto" arguments."""
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
