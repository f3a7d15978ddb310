"""The chunked-overlap micro-benchmark of arXiv 2609.34162, §3.4: one layer's host path, whole vs in chunks.

Fed the measured un-chunked time of a path, the profile splits it into its stages by rate (the DMA at the
profile's single-GPU PCIe rate, the rest on the host) and the chunks flow through the stages as a pipeline.
"""

from __future__ import annotations

import math

from slidedp_lightning.steptime.analytic import pipeline
from slidedp_lightning.steptime.profiles import Profile

# SlideFormer's chunk (its public code): 32 M elements
CHUNK_ELEMS = 32 * 2**20
# host bytes per parameter: FP32 -> BF16 conversion (read 4, write 2) and the driver's staging copy of a pageable
# BF16 buffer into pinned memory (read 2, write 2); chunked, the conversion writes the pinned chunk directly
CONVERT_BYTES, STAGE_BYTES = 6, 4


def chunked_param_path(unchunked_s: float, params: int, profile: Profile, chunk_elems: int = CHUNK_ELEMS) -> float:
    """Convert + transfer in chunks: convert chunk k+1 while chunk k is transferred."""
    dma = params * 2 / profile.h2d_per_gpu(1)
    host = unchunked_s - dma
    if host <= 0:
        raise ValueError("the un-chunked time is shorter than the DMA alone at the profile's H2D rate")
    convert = host * CONVERT_BYTES / (CONVERT_BYTES + STAGE_BYTES)
    n = math.ceil(params / chunk_elems)
    return pipeline([[convert / n, dma / n]] * n)


def chunked_grad_path(
    unchunked_s: float, params: int, profile: Profile, chunk_elems: int = CHUNK_ELEMS, grad_bytes: int = 4
) -> float:
    """Transfer + update in chunks: each landed gradient chunk is updated at once."""
    dma = params * grad_bytes / profile.d2h_per_gpu(1)
    update = unchunked_s - dma
    if update <= 0:
        raise ValueError("the un-chunked time is shorter than the D2H alone at the profile's rate")
    n = math.ceil(params / chunk_elems)
    return pipeline([[dma / n, update / n]] * n)
