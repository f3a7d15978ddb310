"""What the user chooses for one engine; everything else is derived (see :class:`EngineConfig`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from slidedp_lightning.constants import (
    GRAD_ROUTES,
    OPTIMIZER_STATES,
    PARAM_ROUTES,
    QUANT_BLOCK,
    UNIT_COPIES,
    UPDATE_MODES,
)
from slidedp_lightning.runtime.activation_policy import ActivationPolicy


def _lane_delay_from_env() -> float:
    return float(os.environ.get("SLIDEDP_TEST_LANE_DELAY_MS", "0"))


def _unit_copies_from_env() -> str:
    return os.environ.get("SLIDEDP_UNIT_COPIES", "auto")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's choices. ``"auto"`` routes and chunk sizes are measured at setup (the resolved config is
    ``engine.config``)."""

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
    max_units_in_flight: int = 2  # units whose gradient may wait for the CPU update before backward waits
    # the ledger's Adam moments: "fp32" (exact) or "int8" (block-wise 8-bit codes + an FP32 absmax per block)
    optimizer_state: str = "fp32"
    # a directory on a local disk: the moments live in a state file there instead of host memory, read ahead and
    # written behind by the update lane (runtime.ledger.disk); None: everything in host memory
    state_dir: str | None = None
    # with state_dir: the FP32 master weights in the state file too (bf16 compute with the BF16 copy only: the
    # devices read the copy, the update lane alone reads and writes the master)
    master_on_disk: bool = False
    # keep the BF16 transfer copy in the ledger (False: units are converted from the FP32 master on the way)
    bf16_copy: bool = True
    # bf16_copy=False under bf16 compute: "host" converts into a reused (pinned) staging buffer and copies BF16,
    # "device" copies the FP32 master and converts on the device; "auto": "host" on CUDA (half the link bytes),
    # "device" on a CPU device (no link: the staging pass is pure overhead, docs/PERFORMANCE.md)
    h2d_convert: str = "auto"
    # on a CPU device, route full, a unit whose ledger source has the compute dtype (the BF16 copy under bf16
    # compute, the master under FP32) can be computed on in the ledger (a copy is a second instance of host memory
    # the ledger holds): "auto" does so for units of at least IN_LEDGER_MIN_BYTES (a smaller copy fits in the cache
    # and acts as a prefetch: computing in place was slower there, docs/PERFORMANCE.md), "never" for every such
    # unit, "always" copies every unit, as on CUDA (default from SLIDEDP_UNIT_COPIES)
    unit_copies: str = field(default_factory=_unit_copies_from_env)
    # test-only fault injection (see lanes.liveness.lane_delay); read from SLIDEDP_TEST_LANE_DELAY_MS
    lane_delay_ms: float = field(default_factory=_lane_delay_from_env)

    @property
    def auto_routes(self) -> bool:
        """Whether a route or the chunk size is left to the route probe (``"auto"``)."""
        return "auto" in (self.param_route, self.grad_route, self.chunk_bytes)

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
        _positive_int("prefetch_window", self.prefetch_window)
        _positive_int("max_units_in_flight", self.max_units_in_flight)
        _positive_int("accumulate", self.accumulate)
        _positive_int("staging_slots", self.staging_slots)
        if self.update_threads is not None:
            _positive_int("update_threads", self.update_threads, "None (auto) or ")
        if self.chunk_bytes not in (None, "auto") and (not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 64):
            raise ValueError(
                f"chunk_bytes must be None (one chunk per unit), 'auto' or an integer >= 64, got {self.chunk_bytes!r}."
            )
        if not isinstance(self.activation_policy, ActivationPolicy):
            raise TypeError(
                "EngineConfig.activation_policy must be an ActivationPolicy; use ActivationPolicy.coerce(...) for "
                "strings, dicts and JSON paths."
            )
        if self.update not in UPDATE_MODES:
            raise ValueError(f"update must be one of {UPDATE_MODES}, got {self.update!r}.")
        if self.optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer_state must be one of {OPTIMIZER_STATES}, got {self.optimizer_state!r}.")
        if not isinstance(self.bf16_copy, bool):
            raise ValueError(f"bf16_copy must be True or False, got {self.bf16_copy!r}.")
        if self.state_dir is not None and (not isinstance(self.state_dir, str) or not self.state_dir):
            raise ValueError(f"state_dir must be None or a directory path, got {self.state_dir!r}.")
        if self.master_on_disk and (self.state_dir is None or not self.bf16_copy):
            raise ValueError(
                "master_on_disk keeps the FP32 master in the state file (state_dir) and the BF16 copy the devices "
                f"read in memory: it needs a state_dir and bf16_copy=True (got {self.state_dir!r}, {self.bf16_copy})."
            )
        if self.state_dir is not None and self.param_route == "replicated":
            raise ValueError(
                "param_route='replicated' keeps a whole ledger per rank; the state on disk is one file per host "
                "shared by its ranks: use param_route='full', 'sharded' or 'auto' with a state directory."
            )
        if self.h2d_convert not in ("host", "device", "auto"):
            raise ValueError(f"h2d_convert must be 'host', 'device' or 'auto', got {self.h2d_convert!r}.")
        if self.unit_copies not in UNIT_COPIES:
            raise ValueError(f"unit_copies must be 'auto', 'always' or 'never', got {self.unit_copies!r}.")
        if self.optimizer_state == "int8" and isinstance(self.chunk_bytes, int) and self.chunk_bytes < 4 * QUANT_BLOCK:
            raise ValueError(
                f"optimizer_state='int8' updates whole blocks of {QUANT_BLOCK} elements: chunk_bytes must be at "
                f"least {4 * QUANT_BLOCK} (got {self.chunk_bytes}), or None / 'auto'."
            )

    @property
    def chunk_elems(self) -> int | None:
        """FP32 elements per gradient chunk (a multiple of 16; of QUANT_BLOCK with int8 moments, so every chunk
        starts on a block), or None for one chunk per unit."""
        if not isinstance(self.chunk_bytes, int):
            return None
        align = QUANT_BLOCK if self.optimizer_state == "int8" else 16
        return max(self.chunk_bytes // 4 // align * align, align)


def _positive_int(name: str, value: object, alternatives: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be {alternatives}an integer >= 1, got {value!r}.")
