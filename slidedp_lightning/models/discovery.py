"""Which adapter a model has, and which module of a LightningModule SlideDP streams: a ``stream_blocks`` mark, else
the registered adapters (transformers models, users' own), else an unambiguous block list."""

from __future__ import annotations

from torch import nn

from slidedp_lightning.models.adapter import ArchitectureAdapter, UnsupportedModelError, registered_adapters
from slidedp_lightning.models.block_list import BlockListAdapter, detect_blocks
from slidedp_lightning.models.hf_decoder import HFDecoderAdapter, blocks_mark


def _marked(model: nn.Module) -> ArchitectureAdapter | None:
    """The adapter of a model marked with ``stream_blocks`` (transformers models keep their own adapter)."""
    if blocks_mark(model) is None:
        return None
    return HFDecoderAdapter() if HFDecoderAdapter.matches(model) else BlockListAdapter()


def _registered(model: nn.Module) -> ArchitectureAdapter | None:
    for cls in registered_adapters():
        if cls.matches(model):
            return cls()
    return None


def adapter_for(model: nn.Module) -> ArchitectureAdapter:
    """The adapter for ``model``: its ``stream_blocks`` mark, else the registered adapters (transformers models),
    else an unambiguous block list; or :class:`UnsupportedModelError` saying clearly why there is none."""
    found = _marked(model) or _registered(model)
    if found is not None:
        return found
    detect_blocks(model)  # raises, naming the model's class and how to name its blocks
    return BlockListAdapter()


def find_streamed_model(root: nn.Module) -> nn.Module:
    """The module of ``root`` (itself included) that SlideDP streams: the outermost one marked with
    ``stream_blocks``, else the outermost one a registered adapter understands (a transformers model inside a
    LightningModule), else ``root`` itself when it has an unambiguous block list. The error names ``root``'s class."""
    modules = list(root.modules())
    for find in (_marked, _registered):
        for module in modules:
            if find(module) is not None:
                return module
    try:
        adapter_for(root)
    except UnsupportedModelError as err:
        known = ", ".join(getattr(c, "name", c.__name__) for c in registered_adapters())
        raise UnsupportedModelError(f"{err} Registered adapters: {known}.") from None
    return root
