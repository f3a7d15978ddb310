"""The memory-bandwidth ceiling of each update variant: kernels that move the same bytes with trivial math."""

from __future__ import annotations

import numpy as np

from cpu_ops import _kernels
from cpu_ops._validate import BF16_BITS, check_vector
from cpu_ops.adamw import _check_state, grad_rows


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
