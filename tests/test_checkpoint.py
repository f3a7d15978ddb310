"""Checkpoint helpers that need no process group: the balanced share and the box decomposition."""

from __future__ import annotations

import math

import pytest
import torch

from slidedp_lightning.checkpoint import boxes, share


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3, 2)])
def test_boxes_cover_a_flat_range_exactly_with_contiguous_boxes(shape):
    n = math.prod(shape)
    index = torch.arange(n).reshape(shape)
    for a in range(n + 1):
        for b in range(a, n + 1):
            covered = torch.zeros(n, dtype=torch.int64)
            found = boxes(shape, a, b)
            assert len(found) <= 2 * len(shape) - 1
            for offsets, sizes, first in found:
                region = index[tuple(slice(o, o + z) for o, z in zip(offsets, sizes))].reshape(-1)
                assert torch.equal(region, torch.arange(first, first + math.prod(sizes)))  # contiguous in memory
                covered[region] += 1
            want = torch.zeros(n, dtype=torch.int64)
            want[a:b] = 1
            assert torch.equal(covered, want), (shape, a, b, found)


def test_share_balances_elements_and_is_deterministic():
    sizes = {"a": 100, "b": 60, "c": 50, "d": 10}
    assert share(sizes, 2) == [["a", "d"], ["b", "c"]] == share(dict(reversed(sizes.items())), 2)
