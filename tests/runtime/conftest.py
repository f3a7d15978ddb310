"""Fixtures of the runtime tests."""

from __future__ import annotations

import pytest
from torch import nn

from slidedp_lightning.runtime.engine import SlideDPEngine
from tests.runtime.helpers import make_engine


@pytest.fixture
def engines():
    """Closes every engine a test made, even when it fails."""
    made: list[SlideDPEngine] = []

    def make(model: nn.Module, **cfg) -> SlideDPEngine:
        engine = make_engine(model, **cfg)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()
