"""Precision plugin: which dtype the units stream in, the autocast around forward, and fp16 loss scaling."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Literal, TypeGuard, get_args

import torch
from lightning.pytorch.plugins.precision import Precision

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import Steppable

SlideDPPrecisionName = Literal["32-true", "bf16-mixed", "16-mixed"]
SUPPORTED_PRECISION: tuple[SlideDPPrecisionName, ...] = get_args(SlideDPPrecisionName)


def _is_supported(precision: str) -> TypeGuard[SlideDPPrecisionName]:
    return precision in SUPPORTED_PRECISION


class SlideDPPrecision(Precision):
    """``32-true``: FP32 units, FP32 gradients. ``bf16-mixed``: units stream as the ledger's BF16 transfer copy,
    forward runs under BF16 autocast, gradients are reduced in FP32 and applied to the FP32 master.
    ``16-mixed``: FP32 units under FP16 autocast with dynamic loss scaling (the semantics of
    ``torch.amp.GradScaler``: start at 2**16, halve on a non-finite step, which is skipped, double after 2000
    finite steps); the engine unscales while applying the deferred update."""

    def __init__(
        self, precision: str = "32-true", device: str = "cpu", init_scale: float = 2.0**16, growth_interval: int = 2000
    ) -> None:
        if not _is_supported(precision):
            raise ValueError(
                f"SlideDP supports precision {SUPPORTED_PRECISION}, got {precision!r}. The FP32 master lives on the "
                "host; pick 'bf16-mixed' for speed or '32-true' for exactness."
            )
        self.precision = precision
        self.device = device
        self.scale = float(init_scale) if precision == "16-mixed" else 1.0
        self.growth_interval = growth_interval
        self._growth_tracker = 0

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16-mixed" else torch.float32

    @property
    def scales_loss(self) -> bool:
        return self.precision == "16-mixed"

    def forward_context(self) -> Any:
        """Lightning's step contexts (train/val/test/predict) all enter this."""
        if self.precision == "bf16-mixed":
            return torch.autocast(self.device, dtype=torch.bfloat16)
        if self.precision == "16-mixed":
            return torch.autocast(self.device, dtype=torch.float16)
        return nullcontext()

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        tensor = super().pre_backward(tensor, module)
        return tensor * self.scale if self.scales_loss else tensor

    def unscale_factor(self) -> float:
        """What the engine multiplies the accumulated gradient by before clipping and applying it."""
        return 1.0 / self.scale

    def update_scale(self, found_inf: bool) -> None:
        """After each optimizer step: back off on a skipped (non-finite) step, grow after a finite streak."""
        if not self.scales_loss:
            return
        if found_inf:
            self.scale *= 0.5
            self._growth_tracker = 0
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self.scale *= 2.0
            self._growth_tracker = 0

    def clip_gradients(self, optimizer, clip_val: float | int = 0.0, gradient_clip_algorithm=None) -> None:
        """Nothing here: the parameters hold no gradients; the engine clips by the exact global norm (or by
        value) when it applies the step."""

    # Lightning's own Precision.optimizer_step carries the same ignore: it adds model and closure to the
    # signature of the Fabric precision it derives from
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Steppable, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Run forward + backward only: the update happens on the CPU as gradients land, not in ``optimizer.step``."""
        return self._wrap_closure(model, optimizer, closure)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self._growth_tracker} if self.scales_loss else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scales_loss and state_dict:
            self.scale = float(state_dict["scale"])
            self._growth_tracker = int(state_dict["growth_tracker"])
