"""bench.pretrained_load's memory acceptance at a small size: 4 local ranks reading a sharded BF16 checkpoint into
the ledger hold no more private memory than building the same model randomly with meta_init, within
max(300 MB, 25 % of one FP32 model) summed over the ranks; transformers' from_pretrained on every rank (a full FP32
copy each) is over that bound, so the measure sees a copy."""

from __future__ import annotations

import pytest

from bench.pretrained_load import make, run

pytestmark = pytest.mark.slow  # 3 jobs of 4 processes each, ~1-2 min on 2 cores

RANKS = 4


def test_four_ranks_from_a_checkpoint_hold_no_more_private_memory_than_random_init(tmp_path) -> None:
    directory = tmp_path / "qwen3"
    params = make(directory, hidden=512, layers=8, shard="40MB")  # ~64 M parameters, several shards
    assert len(list(directory.glob("*.safetensors"))) >= 3
    bound = max(300e6, 0.25 * 4 * params)
    new = run("load", directory, RANKS, "new", timeout=600)
    meta = run("load", directory, RANKS, "meta", timeout=600)
    naive = run("load", directory, RANKS, "naive", timeout=600)
    extra = new["anon_peak_sum"] - meta["anon_peak_sum"]
    assert extra <= bound, f"from_pretrained held {extra / 1e6:.0f} MB more private memory than meta_init"
    copies = naive["anon_peak_sum"] - meta["anon_peak_sum"]
    assert copies > bound, f"the naive path measured only {copies / 1e6:.0f} MB above meta_init"
    assert new["gbps"] > 0 and new["seconds"] > 0
