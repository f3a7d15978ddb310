"""runtime.grads: the flat gradient layout written whole or piece by piece (host_reduce chunks)."""

from __future__ import annotations

import torch

from slidedp_lightning.runtime.grads import _fill_flat
from tests.runtime.test_layout import layout_of, tiny_qwen3


def test_pieces_of_the_flat_gradient_add_up_to_the_whole_with_zeros_in_gaps_and_padding():
    layout = layout_of(tiny_qwen3(tied=False), world_size=2)
    unit = layout.units[1]
    grads = [torch.randn(s.shape) for s in unit.slots]
    whole = torch.full((unit.padded,), float("nan"))
    _fill_flat(whole, unit, grads)
    assert not whole.isnan().any(), "every element is written, gaps and padding included"
    for a, b in unit.gaps():
        assert not whole[a:b].any()
    for slot, g in zip(unit.slots, grads):
        assert torch.equal(whole[slot.offset : slot.end], g.reshape(-1))
    pieced = torch.full((unit.padded,), float("nan"))
    edges = [0, 7, 1000, 1001, unit.slots[1].offset + 3, unit.padded - 5, unit.padded]  # across slots and gaps
    for a, b in zip(edges, edges[1:]):
        _fill_flat(pieced, unit, grads, a, b)
        assert pieced[b:].isnan().all(), "a piece writes nothing past its end"
    assert torch.equal(pieced, whole)
