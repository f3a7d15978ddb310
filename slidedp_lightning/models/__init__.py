"""Per-architecture knowledge: how a model splits into streaming units, and how to materialize it."""

from slidedp_lightning.models.adapter import (
    ArchitectureAdapter,
    UnitSpec,
    UnsupportedModelError,
    adapter_for,
    register_adapter,
)
from slidedp_lightning.models.hf_decoder import HFDecoderAdapter

__all__ = [
    "ArchitectureAdapter",
    "HFDecoderAdapter",
    "UnitSpec",
    "UnsupportedModelError",
    "adapter_for",
    "register_adapter",
]
