"""runtime.layout: streaming units of a tiny Qwen3, flat offsets, shards and the errors for odd models."""

from __future__ import annotations

import pytest
from torch import nn

from slidedp_lightning.models import HFDecoderAdapter, UnsupportedModelError
from slidedp_lightning.runtime.layout import PARAM_ALIGN, SHARD_ALIGN, build_layout
from tests.helpers import tiny_model
from tests.runtime.helpers import layout_of


@pytest.mark.parametrize("tied", [True, False])
def test_units_and_ownership(tied: bool) -> None:
    model = tiny_model(tied)
    layout = layout_of(model)
    assert [u.name for u in layout.units] == ["embed", "layers.0", "layers.1", "head"]
    assert [u.index for u in layout.units] == [0, 1, 2, 3]

    owner = {s.name: u.index for u, s in layout.slots()}
    # every parameter (tied ones once) is owned by exactly one unit
    assert sorted(owner) == sorted(n for n, _ in model.named_parameters())
    assert len(layout.slots()) == len(list(model.parameters()))
    assert layout.num_params == sum(p.numel() for p in model.parameters())
    assert owner["model.embed_tokens.weight"] == 0
    assert owner["model.norm.weight"] == 3
    for i in range(2):
        assert {u for n, u in owner.items() if n.startswith(f"model.layers.{i}.")} == {i + 1}

    head = layout.units[3]
    compute = {id(m): units for m, units in layout.compute_modules}
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert "lm_head.weight" not in owner  # named_parameters dedups the tied weight under the embedding name
        embed_slot = layout.units[0].slots[0]
        assert (model.lm_head, "weight") in embed_slot.locations
        assert (model.model.embed_tokens, "weight") in embed_slot.locations
        assert [s.name for s in head.slots] == ["model.norm.weight"]
        assert compute[id(model.lm_head)] == (0,)  # the tied head borrows the embedding unit
    else:
        assert owner["lm_head.weight"] == 3
        assert [s.name for s in head.slots] == ["model.norm.weight", "lm_head.weight"]
        assert compute[id(model.lm_head)] == (3,)
        assert all(len(s.locations) == 1 for _, s in layout.slots())
    assert compute[id(model.model.embed_tokens)] == (0,)
    assert compute[id(model.model.norm)] == (3,)
    assert compute[id(model.model.layers[0])] == (1,)
    assert compute[id(model.model.layers[1])] == (2,)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_offsets_padding_shards_and_gaps(tied: bool, world_size: int) -> None:
    model = tiny_model(tied)
    layout = layout_of(model, world_size)
    params = dict(model.named_parameters())
    offset = 0
    for unit in layout.units:
        assert unit.world_size == world_size
        assert unit.offset == offset, "units are laid out back to back"
        offset += unit.padded
        assert unit.padded % (world_size * SHARD_ALIGN) == 0
        assert unit.padded > 0

        # parameters: aligned, in order, inside the unit, shapes as in the model
        prev_end = 0
        for slot in unit.slots:
            assert slot.offset % PARAM_ALIGN == 0
            assert slot.offset >= prev_end
            assert slot.end == slot.offset + slot.numel
            assert slot.shape == tuple(params[slot.name].shape)
            assert slot.numel == params[slot.name].numel()
            prev_end = slot.end
        assert prev_end <= unit.padded
        assert prev_end > unit.padded - world_size * SHARD_ALIGN, "no more tail padding than one shard row"

        # gaps + parameter ranges tile [0, padded) exactly, without overlap
        pieces = sorted([(s.offset, s.end) for s in unit.slots] + unit.gaps())
        pos = 0
        for a, b in pieces:
            assert a == pos and b > a
            pos = b
        assert pos == unit.padded
        for a, b in unit.gaps():
            assert not any(s.offset < b and a < s.end for s in unit.slots)

        # shards partition [0, padded) and each starts on a page of FP32
        shards = [unit.shard(r) for r in range(world_size)]
        assert shards[0][0] == 0 and shards[-1][1] == unit.padded
        for (_, b0), (a1, _) in zip(shards, shards[1:]):
            assert b0 == a1
        for a, b in shards:
            assert a % SHARD_ALIGN == 0
            assert b - a == unit.shard_numel
    assert layout.total == offset
    assert layout.max_unit == max(u.padded for u in layout.units)


def test_frozen_parameter_keeps_its_slot_untrainable() -> None:
    model = tiny_model(tied=False)
    model.model.layers[1].mlp.up_proj.weight.requires_grad_(False)
    layout = layout_of(model)
    frozen = [s.name for _, s in layout.slots() if not s.trainable]
    assert frozen == ["model.layers.1.mlp.up_proj.weight"]
    unit = next(u for u in layout.units if u.name == "layers.1")
    assert unit.has_frozen and not unit.frozen and unit.trainable_slots == len(unit.slots) - 1
    assert layout.num_trainable == layout.num_params - model.model.layers[1].mlp.up_proj.weight.numel()
    # laid out after every trainable parameter of its unit, from a shard boundary on: the trainable prefix
    assert unit.slots[-1].name == "model.layers.1.mlp.up_proj.weight"
    assert unit.trainable_extent == unit.slots[-1].offset and unit.trainable_extent % SHARD_ALIGN == 0
    assert all(s.end <= unit.trainable_extent for s in unit.slots[:-1])
    assert [s.offset for s in unit.slots] == sorted(s.offset for s in unit.slots)
    others = [u for u in layout.units if u is not unit]
    assert all(u.trainable_extent == u.padded for u in others)
    model.model.layers[0].requires_grad_(False)
    assert next(u for u in layout_of(model).units if u.name == "layers.0").trainable_extent == 0


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm = tiny_model(tied=True)
        self.extra = nn.Linear(4, 4)


def test_parameter_outside_units_raises() -> None:
    root = Wrapper()
    with pytest.raises(UnsupportedModelError, match="outside the streamed model's units") as info:
        build_layout(root, HFDecoderAdapter().units(root.lm), 1)
    assert "extra.weight" in str(info.value)
    assert "extra.bias" in str(info.value)


def test_wrapper_without_extra_parameters_is_fine() -> None:
    root = Wrapper()
    del root.extra
    layout = build_layout(root, HFDecoderAdapter().units(root.lm), 1)
    assert layout.units[0].slots[0].name == "lm.model.embed_tokens.weight"  # named relative to the root
    assert layout.num_params == sum(p.numel() for p in root.parameters())
