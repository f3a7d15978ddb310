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
from slidedp_lightning.runtime.topology import Topology

ActivationOption = str | dict | ActivationPolicy | UnitPolicy | AutoPolicy | None


@dataclass(frozen=True)
class SlideDPOptions:
    """The user's choices (see :class:`~slidedp_lightning.SlideDPStrategy` for each one's meaning)."""

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
    optimizer_state: OptimizerState = "fp32"
    bf16_copy: bool = True

    def __post_init__(self) -> None:
        if self.optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(
                f"optimizer_state must be one of {OPTIMIZER_STATES} (the Adam moments in the host ledger: exact FP32 "
                f"or block-wise 8-bit), got {self.optimizer_state!r}."
            )
        if not isinstance(self.bf16_copy, bool):
            raise ValueError(f"bf16_copy must be True or False, got {self.bf16_copy!r}.")
        if self.optimizer_state == "int8" and self.checkpoint_format == "full":
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
            optimizer_state=self.optimizer_state,
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

    def topology(self, global_rank: int, local_rank: int, ranks_per_host: int, hosts: int) -> Topology:
        """This rank's :class:`Topology` for these options, its process groups created (collective: every rank)."""
        routes = self.base_engine_config()
        return Topology.build(
            global_rank=global_rank,
            local_rank=local_rank,
            ranks_per_host=ranks_per_host,
            hosts=hosts,
            host_layout=self.host_layout,
            ledger_per_rank=routes.param_route == "replicated" and hosts * ranks_per_host > 1,
            param_group=routes.param_route in ("sharded", "auto"),
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
