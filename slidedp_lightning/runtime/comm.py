"""Collectives under the names of this torch release (2.13 renamed the tensor forms; older ones have the old)."""

from __future__ import annotations

import torch.distributed as dist

all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
