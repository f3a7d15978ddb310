"""Per-architecture knowledge: how a model splits into streaming units, and how to materialize it."""

from slidedp_lightning.models.adapter import (
    ArchitectureAdapter,
    UnitSpec,
    UnsupportedModelError,
    adapter_for,
    find_streamed_model,
    register_adapter,
)
from slidedp_lightning.models.block_list import BlockListAdapter, stream_blocks
from slidedp_lightning.models.hf_decoder import HFDecoderAdapter

__all__ = [
    "ArchitectureAdapter",
    "BlockListAdapter",
    "HFDecoderAdapter",
    "UnitSpec",
    "UnsupportedModelError",
    "adapter_for",
    "find_streamed_model",
    "register_adapter",
    "stream_blocks",
]
