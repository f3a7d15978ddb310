"""The interface between the runtime and a model architecture, and the adapter registry (which adapter a model
has: :mod:`.discovery`)."""

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


def registered_adapters() -> list[type[ArchitectureAdapter]]:
    """The registered adapter classes, the latest registered first (the order they are asked in)."""
    return list(reversed(_ADAPTERS))
