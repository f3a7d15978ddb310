"""How SlideDP splits each model of tests/integration/library_models.py into streaming units (in process, no
training): an embedding-side unit, one unit per decoder block of the library's own block class, a head-side unit,
and every parameter in one of them. tests/integration/test_libraries.py trains each against DDP + AdamW; a failure
here names the split. A library that is not installed skips its case."""

from __future__ import annotations

import pytest

from slidedp_lightning.models import adapter_for
from tests.integration import library_models

VOCAB, SEQ = 96, 24


@pytest.mark.parametrize("name", library_models.NAMES)
def test_library_model_splits_into_units(name: str) -> None:
    library = library_models.LIBRARIES[name]
    pytest.importorskip(library.module)
    model = library_models.build(name, VOCAB, SEQ, seed=0)
    specs = adapter_for(model).units(model)
    layers = library_models.LAYERS
    assert [s.name for s in specs] == ["embed", *(f"layers.{i}" for i in range(layers)), "head"]
    assert [s.block for s in specs] == [False, *([True] * layers), False]
    blocks = [type(s.modules[0]).__name__ for s in specs if s.block]
    assert blocks == [library.block] * layers, f"{name}: the units stream {blocks}, not its {library.block}s"
    held = {id(p) for s in specs for m in s.modules for p in m.parameters()}
    outside = [n for n, p in model.named_parameters() if id(p) not in held]
    assert not outside, f"{name}: parameters in no unit: {outside[:5]}"
