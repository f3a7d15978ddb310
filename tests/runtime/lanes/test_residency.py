"""Residency: each unit is copied to the device exactly when the step needs it, and leaves afterwards."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from slidedp_lightning.runtime import EngineConfig, SlideDPEngine


def _engine(tied: bool, window: int) -> tuple[torch.nn.Module, SlideDPEngine]:
    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    engine = SlideDPEngine(
        model, EngineConfig(prefetch_window=window), device=torch.device("cpu"), compute_dtype=torch.float32
    )
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    return model, engine


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("window", [1, 2, 3])
def test_each_unit_visits_the_device_once_per_pass(tied, window):
    model, engine = _engine(tied, window)
    res = engine.residency
    try:
        x = torch.randint(0, 64, (2, 8))
        loss = model(input_ids=x, labels=x).loss
        # forward done: only the last unit it used stays (backward starts with it), nothing else was prefetched
        last_used = 0 if tied else len(engine.layout.units) - 1
        assert [u for u, r in enumerate(res.resident) if r] == [last_used] and not res.pending
        forward_fills = list(res.fills)
        embed_uses = 2 if tied else 1  # a tied lm_head borrows the embedding again at the end of forward
        assert forward_fills == [embed_uses] + [1] * (len(forward_fills) - 1)
        loss.backward()
        engine.end_step()
        assert not any(res.resident) and not res.pending
        backward_fills = [b - f for b, f in zip(res.fills, forward_fills)]
        expected = [1] * len(backward_fills)
        expected[last_used] = 0
        assert backward_fills == expected
        unit_bytes = [u.padded * 4 for u in engine.layout.units]
        # at most `window` units in flight in one direction, plus the tied embedding held through backward
        bound = window * max(unit_bytes) + (unit_bytes[0] if tied else 0) + max(unit_bytes)
        assert res.peak_resident_bytes <= bound
    finally:
        engine.close()


def test_binding_holds_one_unit_on_the_device_at_a_time(monkeypatch):
    """On a GPU every byte torch.empty returns is real: making all units' buffers before emptying them would need
    the whole model on the device at setup. Each buffer made by the residency is empty before the next is made."""
    import sys

    from slidedp_lightning.runtime.lanes import residency as params

    made: list[torch.Tensor] = []
    held_at_each: list[int] = []
    empty = torch.empty

    def tracked(*args, **kwargs):
        out = empty(*args, **kwargs)
        if sys._getframe(1).f_code.co_filename == params.__file__:
            held_at_each.append(sum(t.untyped_storage().nbytes() > 0 for t in made))
            made.append(out)
        return out

    monkeypatch.setattr(params.torch, "empty", tracked)
    _, engine = _engine(tied=False, window=1)
    monkeypatch.undo()
    try:
        assert len(made) == len(engine.layout.units) >= 4
        assert held_at_each == [0] * len(made), held_at_each
        assert all(t.untyped_storage().nbytes() == 0 for t in engine.residency.buffers)
    finally:
        engine.close()
