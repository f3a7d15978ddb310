"""The interface between the runtime and a model architecture, and the adapter registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

from torch import nn


class UnsupportedModelError(ValueError):
    """The model has no streaming-unit adapter, or its shape is not supported."""


@dataclass(frozen=True)
class UnitSpec:
    """One streaming unit: the modules whose parameters it owns, in forward order.

    A module listed in a unit is also a *compute module*: its forward makes resident every unit that
    owns one of its parameters (a tied ``lm_head`` borrows the embedding unit this way).
    """

    name: str
    modules: tuple[nn.Module, ...]
    block: bool = False  # a decoder block (modules[0]): activation policies apply to it


class ArchitectureAdapter(Protocol):
    """What the runtime needs to know about one family of models."""

    name: str

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        """True when this adapter understands ``model``."""

    def units(self, model: nn.Module) -> list[UnitSpec]:
        """The streaming units in forward order (embedding, blocks, head)."""

    def init_weights(self, model: nn.Module, module: nn.Module) -> None:
        """Initialize ``module`` (already materialized on CPU, uninitialized memory) as the model would."""

    def materialize_buffers(self, model: nn.Module) -> None:
        """Recompute non-persistent buffers (rotary frequencies, ...) left on the meta device."""


_A = TypeVar("_A", bound=type[ArchitectureAdapter])

_ADAPTERS: list[type[ArchitectureAdapter]] = []


def register_adapter(cls: _A) -> _A:
    """Class decorator: make an adapter discoverable by :func:`adapter_for`; adapters registered later are asked
    first (a user's adapter takes precedence over the built-in ones)."""
    _ADAPTERS.append(cls)
    return cls


def _marked(model: nn.Module) -> ArchitectureAdapter | None:
    """The adapter of a model marked with ``stream_blocks`` (transformers models keep their own adapter)."""
    from slidedp_lightning.models.block_list import BlockListAdapter
    from slidedp_lightning.models.hf_decoder import HFDecoderAdapter, blocks_mark

    if blocks_mark(model) is None:
        return None
    return HFDecoderAdapter() if HFDecoderAdapter.matches(model) else BlockListAdapter()


def _registered(model: nn.Module) -> ArchitectureAdapter | None:
    for cls in reversed(_ADAPTERS):
        if cls.matches(model):
            return cls()
    return None


def adapter_for(model: nn.Module) -> ArchitectureAdapter:
    """The adapter for ``model``: its ``stream_blocks`` mark, else the registered adapters (transformers models),
    else an unambiguous block list; or :class:`UnsupportedModelError` saying clearly why there is none."""
    from slidedp_lightning.models.block_list import BlockListAdapter, detect_blocks

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
        known = ", ".join(getattr(c, "name", c.__name__) for c in reversed(_ADAPTERS))
        raise UnsupportedModelError(f"{err} Registered adapters: {known}.") from None
    return root
