"""Precision plugin: which dtype the units stream in, and the autocast around forward."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision

SUPPORTED_PRECISION = ("32-true", "bf16-mixed")


class SlideDPPrecision(Precision):
    """``32-true``: FP32 units, FP32 gradients. ``bf16-mixed``: units stream as the ledger's BF16 transfer copy,
    forward runs under BF16 autocast, gradients are reduced in FP32 and applied to the FP32 master."""

    def __init__(self, precision: str = "32-true", device: str = "cpu") -> None:
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(
                f"SlideDP supports precision {SUPPORTED_PRECISION}, got {precision!r}. The FP32 master lives on the "
                "host; pick 'bf16-mixed' for speed or '32-true' for exactness (fp16 loss scaling is not supported yet)."
            )
        self.precision = precision
        self.device = device

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16-mixed" else torch.float32

    def forward_context(self) -> Any:
        """Lightning's step contexts (train/val/test/predict) all enter this."""
        if self.precision == "bf16-mixed":
            return torch.autocast(self.device, dtype=torch.bfloat16)
        return nullcontext()

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Run forward + backward only: the update happens on the CPU as gradients land, not in ``optimizer.step``."""
        return self._wrap_closure(model, optimizer, closure)
