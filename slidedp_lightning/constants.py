"""Names and sizes that the runtime, the step-time model and the strategy share, defined once.

Pure: imports nothing but the standard library, so the step-time model's arithmetic can use it without the
runtime, the kernels or Lightning.
"""

from __future__ import annotations

from typing import Literal, get_args

ParamRoute = Literal["full", "sharded", "replicated"]
GradRoute = Literal["gpu_reduce", "host_reduce"]
HostLayout = Literal["replicated", "sharded"]
UpdateMode = Literal["immediate", "deferred"]
CheckpointFormat = Literal["distributed", "full"]
Precision = Literal["bf16-mixed", "16-mixed", "32-true"]

PARAM_ROUTES: tuple[str, ...] = get_args(ParamRoute)
GRAD_ROUTES: tuple[str, ...] = get_args(GradRoute)
HOST_LAYOUTS: tuple[str, ...] = get_args(HostLayout)
UPDATE_MODES: tuple[str, ...] = get_args(UpdateMode)
CHECKPOINT_FORMATS: tuple[str, ...] = get_args(CheckpointFormat)
PRECISIONS: tuple[str, ...] = get_args(Precision)

# The ledger per (padded) parameter: FP32 master, exp_avg and exp_avg_sq, and the BF16 transfer copy.
MASTER_BYTES = 4
MOMENT_BYTES = 4
BF16_COPY_BYTES = 2
LEDGER_BYTES_PER_PARAM = MASTER_BYTES + 2 * MOMENT_BYTES + BF16_COPY_BYTES


def update_bytes_per_param(grad_itemsize: int, rows: int = 1, bf16_out: bool = False) -> int:
    """Bytes one fused AdamW update moves per parameter (the "28 B/param" convention for FP32 AdamW).

    Reads master, exp_avg, exp_avg_sq (12 B) and ``rows`` gradients; writes the same three (12 B) and, with
    ``bf16_out``, the 2 B BF16 copy. Write-allocate reads are not counted.
    """
    state = MASTER_BYTES + 2 * MOMENT_BYTES
    return 2 * state + rows * grad_itemsize + (BF16_COPY_BYTES if bf16_out else 0)
