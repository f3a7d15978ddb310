"""The engine never changes the training thread's torch thread count (CPU kernels run on the update lane)."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from slidedp_lightning.runtime import EngineConfig, SlideDPEngine


def test_setup_and_steps_keep_torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = Qwen3Config(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
        model = Qwen3ForCausalLM(cfg)
        engine = SlideDPEngine(model, EngineConfig(), device=torch.device("cpu"), compute_dtype=torch.float32)
        try:
            engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
            for _ in range(2):
                x = torch.randint(0, 64, (2, 8))
                model(input_ids=x, labels=x).loss.backward()
                engine.end_step()
            engine.synchronize()
            assert torch.get_num_threads() == 1
        finally:
            engine.close()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
