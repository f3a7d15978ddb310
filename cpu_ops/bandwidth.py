"""The memory-bandwidth ceiling of each update variant: kernels that move the same bytes with trivial math."""

from __future__ import annotations

import numpy as np

from cpu_ops import _kernels, _kernels8
from cpu_ops._validate import BF16_BITS, FP32, check_vector
from cpu_ops.adamw import _check_state, grad_rows
from cpu_ops.adamw8 import CODES, num_blocks


def adam_shaped_copy(
    param: np.ndarray,
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    grads: np.ndarray,
    bf16_out: np.ndarray | None = None,
) -> None:
    """Touch the arrays exactly as :func:`cpu_ops.adamw_update` / ``adamw_update_sum`` would, trivially.

    ``grads``: a 1-D gradient (float32 or bf16 bits) or an (R, n) array of gradient slots. Values change
    (param -= g, moments += g): use scratch buffers.
    """
    n = _check_state(param, exp_avg, exp_avg_sq)
    rows = grad_rows(grads[None, :] if grads.ndim == 1 else grads, n)
    if bf16_out is None:
        _kernels.adam_shaped_copy_kernel(param, exp_avg, exp_avg_sq, rows)
    else:
        check_vector("bf16_out", bf16_out, n, (BF16_BITS,), writeable=True)
        _kernels.adam_shaped_copy_bf16_out_kernel(param, exp_avg, exp_avg_sq, rows, bf16_out)


def adam8_shaped_copy(
    param: np.ndarray,
    exp_avg_q: np.ndarray,
    exp_avg_sq_q: np.ndarray,
    exp_avg_absmax: np.ndarray,
    exp_avg_sq_absmax: np.ndarray,
    grads: np.ndarray,
    bf16_out: np.ndarray | None = None,
) -> None:
    """Touch the arrays exactly as :func:`cpu_ops.adamw8_update` would, trivially.

    Reads and writes param, both code arrays and both absmax arrays, reads ``grads`` (1-D or (R, n) rows) and
    writes ``bf16_out``; values change (param -= g, codes += 1, scales += 1): use scratch buffers.
    """
    check_vector("param", param, None, (FP32,), writeable=True)
    n = param.shape[0]
    nblocks = num_blocks(n)
    check_vector("exp_avg_q", exp_avg_q, n, (CODES,), writeable=True)
    check_vector("exp_avg_sq_q", exp_avg_sq_q, n, (CODES,), writeable=True)
    check_vector("exp_avg_absmax", exp_avg_absmax, nblocks, (FP32,), writeable=True)
    check_vector("exp_avg_sq_absmax", exp_avg_sq_absmax, nblocks, (FP32,), writeable=True)
    rows = grad_rows(grads[None, :] if grads.ndim == 1 else grads, n)
    if bf16_out is not None:
        check_vector("bf16_out", bf16_out, n, (BF16_BITS,), writeable=True)
    if n:
        _kernels8.adam8_shaped_copy_kernel(
            param, exp_avg_q, exp_avg_sq_q, exp_avg_absmax, exp_avg_sq_absmax, rows, bf16_out
        )
