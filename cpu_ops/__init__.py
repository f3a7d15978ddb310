"""Host-side optimizer kernels: fused Numba Adam/AdamW, bf16 conversion, thread budgets."""

from cpu_ops.accumulate import accumulate, sum_squares
from cpu_ops.adamw import adamw_update, adamw_update_sum
from cpu_ops.adamw8 import MOMENT_FORMAT, QUANT_BLOCK, adamw8_update, dequantize_blockwise, quantize_blockwise
from cpu_ops.bandwidth import adam8_shaped_copy, adam_shaped_copy
from cpu_ops.convert import bf16_to_fp32, fp32_to_bf16, widen_bf16
from cpu_ops.threads import logical_cpus, physical_cores, set_kernel_threads, start_kernel_pool, thread_budget
from cpu_ops.warmup import is_vectorized, warmup

__all__ = [
    "MOMENT_FORMAT",
    "QUANT_BLOCK",
    "accumulate",
    "adam8_shaped_copy",
    "adam_shaped_copy",
    "adamw_update",
    "adamw8_update",
    "adamw_update_sum",
    "bf16_to_fp32",
    "dequantize_blockwise",
    "fp32_to_bf16",
    "is_vectorized",
    "logical_cpus",
    "physical_cores",
    "quantize_blockwise",
    "set_kernel_threads",
    "start_kernel_pool",
    "sum_squares",
    "thread_budget",
    "warmup",
    "widen_bf16",
]
