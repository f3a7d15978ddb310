"""Per-architecture knowledge: how a model splits into streaming units, and how to materialize it."""

from slidedp_lightning.models.adapter import (
    ArchitectureAdapter,
    UnitSpec,
    UnsupportedModelError,
    register_adapter,
)
from slidedp_lightning.models.block_list import BlockListAdapter, stream_blocks
from slidedp_lightning.models.discovery import adapter_for, find_streamed_model
from slidedp_lightning.models.hf_decoder import HFDecoderAdapter
from slidedp_lightning.models.structure import HiddenUse, hidden_uses

__all__ = [
    "ArchitectureAdapter",
    "BlockListAdapter",
    "HFDecoderAdapter",
    "HiddenUse",
    "UnitSpec",
    "UnsupportedModelError",
    "adapter_for",
    "find_streamed_model",
    "hidden_uses",
    "register_adapter",
    "stream_blocks",
]
