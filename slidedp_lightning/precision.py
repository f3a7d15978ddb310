"""Precision plugins: which dtype the units stream in, the autocast around forward, and fp16 loss scaling, shared by
the Trainer's (:class:`SlideDPPrecision`) and Fabric's (:class:`SlideDPFabricPrecision`) through :class:`LossScaling`."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Literal, TypeGuard, TypeVar, get_args

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT_STR
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.plugins.precision import Precision

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import Steppable

SlideDPPrecisionName = Literal["32-true", "bf16-mixed", "16-mixed"]
SUPPORTED_PRECISION: tuple[SlideDPPrecisionName, ...] = get_args(SlideDPPrecisionName)


def _is_supported(precision: str) -> TypeGuard[SlideDPPrecisionName]:
    return precision in SUPPORTED_PRECISION


class LossScaling:
    """The semantics both front ends' SlideDP precisions share (the Trainer's :class:`SlideDPPrecision`, Fabric's
    :class:`SlideDPFabricPrecision`): ``32-true``: FP32 units, FP32 gradients. ``bf16-mixed``: units stream as
    the ledger's BF16 transfer copy, forward runs under BF16 autocast, gradients are reduced in FP32 and applied to
    the FP32 master. ``16-mixed``: FP32 units under FP16 autocast with dynamic loss scaling (the semantics of
    ``torch.amp.GradScaler``: start at 2**16, halve on a non-finite step, which is skipped, double after 2000
    finite steps); the engine unscales while applying the deferred update."""

    precision: _PRECISION_INPUT_STR  # one of SUPPORTED_PRECISION (typed as Lightning's precision plugins type it)

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
        """Autocast around forward (Lightning's step contexts and Fabric's wrapped forward enter this)."""
        if self.precision == "bf16-mixed":
            return torch.autocast(self.device, dtype=torch.bfloat16)
        if self.precision == "16-mixed":
            return torch.autocast(self.device, dtype=torch.float16)
        return nullcontext()

    def scale_loss(self, tensor: torch.Tensor) -> torch.Tensor:
        """The loss backward starts from (times the loss scale under ``16-mixed``)."""
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

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self._growth_tracker} if self.scales_loss else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scales_loss and state_dict:
            self.scale = float(state_dict["scale"])
            self._growth_tracker = int(state_dict["growth_tracker"])


P = TypeVar("P", bound=LossScaling)


def slidedp_precision(plugin: Any, kind: type[P], front_end: str) -> P | None:
    """The SlideDP precision of class ``kind`` standing for the precision plugin Lightning chose (None stays None);
    refuses, naming ``front_end``'s flag, a precision SlideDP does not implement."""
    if plugin is None or isinstance(plugin, kind):
        return plugin
    name = getattr(plugin, "precision", None)
    if name not in SUPPORTED_PRECISION:
        raise ValueError(
            f"SlideDP supports precision {SUPPORTED_PRECISION}; got {name or type(plugin).__name__!r}. "
            f"Use {front_end}(precision='bf16-mixed'), '16-mixed' or '32-true'."
        )
    return kind(name, getattr(plugin, "device", "cpu"))


class SlideDPPrecision(LossScaling, Precision):
    """The Trainer's SlideDP precision (semantics: :class:`LossScaling`)."""

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        return self.scale_loss(super().pre_backward(tensor, module))

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


class SlideDPFabricPrecision(LossScaling, FabricPrecision):
    """Fabric's SlideDP precision (semantics: :class:`LossScaling`). As Fabric's own mixed precision, floating-point
    inputs of the wrapped forward are cast to the compute dtype and outputs back to the default dtype."""

    def convert_input(self, data: Any) -> Any:
        if self.precision == "32-true":
            return data
        dtype = torch.float16 if self.precision == "16-mixed" else torch.bfloat16
        return apply_to_collection(data, torch.Tensor, _convert_fp_tensor, dst_type=dtype)

    def convert_output(self, data: Any) -> Any:
        if self.precision == "32-true":
            return data
        return apply_to_collection(data, torch.Tensor, _convert_fp_tensor, dst_type=torch.get_default_dtype())

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        self.scale_loss(tensor).backward(*args, **kwargs)

    def unscale_gradients(self, optimizer: Any) -> None:
        """Nothing here: the engine unscales while applying the deferred update."""
