"""What checkpoints and exports read of a rank's engine: a small typed view, so that they depend on the host state
(:class:`~slidedp_lightning.runtime.ledger.state.LedgerState`), where the rank sits
(:class:`~slidedp_lightning.runtime.topology.Topology`) and the units, not on the whole engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from slidedp_lightning.runtime.config import EngineConfig
    from slidedp_lightning.runtime.layout import Layout
    from slidedp_lightning.runtime.ledger.state import LedgerState
    from slidedp_lightning.runtime.topology import Topology


class EngineView(Protocol):
    """The parts of :class:`~slidedp_lightning.runtime.engine.SlideDPEngine` a checkpoint or an export uses."""

    @property
    def state(self) -> LedgerState:
        """The ledger's named views: parameters, moments, scales, buffers."""

    @property
    def topology(self) -> Topology:
        """This rank's place in the job and its groups."""

    @property
    def layout(self) -> Layout:
        """The units and their parameter slots."""

    @property
    def config(self) -> EngineConfig:
        """The engine's resolved choices (optimizer state format, BF16 copy)."""

    @property
    def model(self) -> nn.Module:
        """The streamed model (its config is recorded in checkpoints)."""

    @property
    def root(self) -> nn.Module:
        """The module the engine was given (a peft wrapper, for adapter exports)."""

    @property
    def step(self) -> int:
        """Optimizer steps applied to the ledger."""

    def synchronize(self) -> None:
        """Wait until every update and copy of this rank has landed in the ledger."""

    def drop_resident(self) -> None:
        """Let go of every unit's device copy (the ledger is about to be overwritten)."""

    def restored(self, step: int, buffers: dict[str, torch.Tensor]) -> None:
        """After a load: the step count and buffers it brought."""
