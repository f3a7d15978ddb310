"""Names and sizes that the runtime, the step-time model and the strategy share, defined once.

Pure: imports nothing but the standard library, so the step-time model's arithmetic can use it without the
runtime, the kernels or Lightning.
"""

from __future__ import annotations

from typing import Literal, get_args

STRATEGY_NAME = "slidedp"  # Trainer(strategy=...) and Fabric(strategy=...), and the Trainer strategy's strategy_name

ParamRoute = Literal["full", "sharded", "replicated"]
GradRoute = Literal["gpu_reduce", "host_reduce"]
HostLayout = Literal["replicated", "sharded"]
UpdateMode = Literal["immediate", "deferred"]
CheckpointFormat = Literal["distributed", "full"]
Precision = Literal["bf16-mixed", "16-mixed", "32-true"]
OptimizerState = Literal["fp32", "int8"]

PARAM_ROUTES: tuple[str, ...] = get_args(ParamRoute)
GRAD_ROUTES: tuple[str, ...] = get_args(GradRoute)
HOST_LAYOUTS: tuple[str, ...] = get_args(HostLayout)
UPDATE_MODES: tuple[str, ...] = get_args(UpdateMode)
CHECKPOINT_FORMATS: tuple[str, ...] = get_args(CheckpointFormat)
PRECISIONS: tuple[str, ...] = get_args(Precision)
OPTIMIZER_STATES: tuple[str, ...] = get_args(OptimizerState)

# The ledger per (padded) parameter: FP32 master, exp_avg and exp_avg_sq, and the BF16 transfer copy.
MASTER_BYTES = 4
MOMENT_BYTES = 4
BF16_COPY_BYTES = 2
LEDGER_BYTES_PER_PARAM = MASTER_BYTES + 2 * MOMENT_BYTES + BF16_COPY_BYTES
# optimizer_state="int8": each moment is one uint8 code per element plus one FP32 absmax per QUANT_BLOCK elements
QUANT_BLOCK = 1024
# a CPU "device" computes a unit of at least this many bytes on the ledger's own range (route full, the ledger's
# source already in the compute dtype) instead of a copy: the last-level cache of a typical server core complex
IN_LEDGER_MIN_BYTES = 32 << 20
UNIT_COPIES = ("auto", "always", "never")  # EngineConfig.unit_copies: in the ledger from that size, never, every one
INT8_MOMENT_BYTES = 1 + 4 / QUANT_BLOCK


def moment_bytes(optimizer_state: str = "fp32") -> float:
    """Bytes of one Adam moment per parameter in the ledger."""
    return INT8_MOMENT_BYTES if optimizer_state == "int8" else MOMENT_BYTES


def ledger_bytes_per_param(optimizer_state: str = "fp32", bf16_copy: bool = True) -> float:
    """The ledger per (padded) trainable parameter: FP32 master, both moments, and the BF16 copy if kept
    (14 B by default; 8.008 B with int8 moments; 6.008 B with int8 moments and no BF16 copy)."""
    return MASTER_BYTES + 2 * moment_bytes(optimizer_state) + (BF16_COPY_BYTES if bf16_copy else 0)


def h2d_bytes_per_param(compute_itemsize: int, bf16_copy: bool = True, convert_on_device: bool = False) -> int:
    """Bytes per parameter copied host -> device when a unit is filled: the compute dtype's, except without a BF16
    copy converted on the device, which copies the FP32 master (4 B) and converts there."""
    return MASTER_BYTES if (compute_itemsize == 2 and not bf16_copy and convert_on_device) else compute_itemsize


def update_bytes_per_param(
    grad_itemsize: int, rows: int = 1, bf16_out: bool = False, optimizer_state: str = "fp32"
) -> float:
    """Bytes one fused AdamW update moves per parameter (the "28 B/param" convention for FP32 AdamW).

    Reads master, exp_avg, exp_avg_sq (12 B; 6.008 B with int8 moments) and ``rows`` gradients; writes the same
    three and, with ``bf16_out``, the 2 B BF16 copy. Write-allocate reads are not counted.
    """
    state = MASTER_BYTES + 2 * moment_bytes(optimizer_state)
    total = 2 * state + rows * grad_itemsize + (BF16_COPY_BYTES if bf16_out else 0)
    return int(total) if total == int(total) else total
