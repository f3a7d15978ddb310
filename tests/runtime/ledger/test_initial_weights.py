"""meta_init: local rank 0 materializes one unit at a time, never the whole model."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from slidedp_lightning.runtime import EngineConfig, SlideDPEngine
from slidedp_lightning.runtime.ledger.initial_weights import InitialWeights


def test_meta_model_is_materialized_one_unit_at_a_time(monkeypatch):
    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    peaks = []
    original = InitialWeights._materialize

    def watched(self, module):
        original(self, module)
        peaks.append(sum(p.numel() for p in model.parameters() if not p.is_meta))

    monkeypatch.setattr(InitialWeights, "_materialize", watched)
    engine = SlideDPEngine(model, EngineConfig(), device=torch.device("cpu"), compute_dtype=torch.float32)
    try:
        largest = max(sum(s.numel for s in u.slots) for u in engine.layout.units)
        total = engine.layout.num_params
        assert peaks, "the meta model was not materialized"
        assert max(peaks) <= largest < total, f"{max(peaks)} params materialized at once; largest unit {largest}"
    finally:
        engine.close(restore=False)
