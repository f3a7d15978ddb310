"""Residency: each unit is copied to the device exactly when the step needs it, and leaves afterwards."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from slidedp_lightning.runtime import EngineConfig, SlideDPEngine
from tests.runtime.helpers import assert_rel_close


def _engine(
    tied: bool, window: int, dtype: torch.dtype = torch.float32, **options
) -> tuple[torch.nn.Module, SlideDPEngine]:
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
        model, EngineConfig(prefetch_window=window, **options), device=torch.device("cpu"), compute_dtype=dtype
    )
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    return model, engine


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("window", [1, 2, 3])
def test_each_unit_visits_the_device_once_per_pass(tied, window):
    model, engine = _engine(tied, window, unit_copies="always")  # the copies a CUDA device makes
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
    _, engine = _engine(tied=False, window=1, unit_copies="always")
    monkeypatch.undo()
    try:
        assert len(made) == len(engine.layout.units) >= 4
        assert held_at_each == [0] * len(made), held_at_each
        assert all(t.untyped_storage().nbytes() == 0 for t in engine.residency.buffers)
    finally:
        engine.close()


@pytest.mark.parametrize(
    "dtype, cfg, in_place",
    [
        (torch.float32, {"unit_copies": "never"}, True),  # FP32 compute reads the master
        (torch.bfloat16, {"unit_copies": "never"}, True),  # bf16 compute reads the BF16 copy
        (torch.bfloat16, {"unit_copies": "never", "bf16_copy": False}, False),  # converted: a buffer of its own
        (torch.float32, {"unit_copies": "always"}, False),
        (torch.float32, {}, False),  # "auto": units this small are copied (the copy is a prefetch into the cache)
    ],
    ids=["fp32", "bf16", "bf16-no-copy", "always", "auto-small-units"],
)
def test_a_cpu_device_computes_on_the_ledger_itself_where_its_dtype_allows(dtype, cfg, in_place):
    """On a CPU device a unit copy would be a second instance of host memory: the parameters are views of the
    ledger's range (no device bytes held), they follow each update, and training still reads each step's weights."""
    model, engine = _engine(tied=True, window=2, dtype=dtype, **cfg)
    res, ledger = engine.residency, engine.ledger
    try:
        lo = ledger.mapping_address()
        hi = lo + ledger.geometry.nbytes
        for _ in range(2):
            x = torch.randint(0, 64, (2, 8))
            model(input_ids=x, labels=x).loss.backward()
            assert engine.end_step()
        assert res.aliased == [in_place] * len(engine.layout.units)
        embed = model.model.embed_tokens.weight
        assert (lo <= embed.data_ptr() < hi) is in_place
        assert (res.peak_resident_bytes == 0) is in_place
        if in_place:  # exactly the embedding's range of the unit's source region
            source, slot = res._sources[0], engine.layout.units[0].slots[0]
            assert embed.data_ptr() == source.data_ptr() + slot.offset * source.element_size()
        held = [p for p in model.parameters()]  # what an optimizer holds past the run
    finally:
        engine.close()
    assert not res.buffers, "closed: no buffer keeps the ledger's mapping alive"
    assert all(p.untyped_storage().nbytes() == 0 for p in held), "closed: no parameter keeps the ledger alive"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_computing_in_the_ledger_trains_bit_identically_to_unit_copies(dtype, tied):
    runs = []
    for copies in ("never", "always"):
        model, engine = _engine(tied, window=2, dtype=dtype, unit_copies=copies)
        try:
            torch.manual_seed(1)
            losses = []
            for _ in range(3):
                x = torch.randint(0, 64, (2, 8))
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
                assert engine.end_step()
                losses.append(loss.item())
            runs.append((losses, engine.state_dict()))
        finally:
            engine.close()
    (losses, state), (copied_losses, copied_state) = runs
    assert losses == copied_losses
    assert_rel_close(state, copied_state, tol=0.0)


def test_unit_copies_takes_its_default_from_the_environment_and_refuses_other_values(monkeypatch):
    monkeypatch.setenv("SLIDEDP_UNIT_COPIES", "never")
    assert EngineConfig().unit_copies == "never"
    monkeypatch.setenv("SLIDEDP_UNIT_COPIES", "sometimes")
    with pytest.raises(ValueError, match="unit_copies must be 'auto', 'always' or 'never', got 'sometimes'"):
        EngineConfig()
