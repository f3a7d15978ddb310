"""Shared test helpers: tiny random decoder models, token data and the relative error the equivalence checks use.

Imported by the test modules and by ``tests/integration/job.py`` (a script, which puts the repository root on
``sys.path`` for it). Only torch and transformers: nothing here starts a process or touches a device.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset
from transformers import PreTrainedConfig, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig

VOCAB = 64
MAX_POSITIONS = 32


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    """max |a - b| / max |b| in float64; ``floor`` bounds the denominator when ``b`` is all zeros."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(floor)).item()


def tiny_config(
    tied: bool = True,
    layers: int = 2,
    *,
    vocab: int = VOCAB,
    max_positions: int = MAX_POSITIONS,
    family: type[PreTrainedConfig] = Qwen3Config,
) -> PreTrainedConfig:
    """A 64-wide decoder config (4 query heads, 2 KV heads of 16, eager attention); Qwen3 unless ``family`` names
    another config class that takes the same arguments (Qwen2, Llama, Mistral)."""
    return family(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )


def tiny_model(
    tied: bool = True, seed: int = 0, layers: int = 2, *, vocab: int = VOCAB, max_positions: int = MAX_POSITIONS
) -> Qwen3ForCausalLM:
    """A tiny Qwen3 (``tiny_config``) with its weights drawn after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(tiny_config(tied, layers, vocab=vocab, max_positions=max_positions))


def tiny_moe_config(layers: int = 2, *, vocab: int = VOCAB, max_positions: int = MAX_POSITIONS) -> Qwen3MoeConfig:
    """A tiny untied Qwen3-MoE: 4 experts of width 32, top-2 routing, router aux loss 0.01."""
    return Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_positions,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


def token_batches(n: int, batch: int, seq: int, *, seed: int = 1, vocab: int = VOCAB) -> list[torch.Tensor]:
    """``n`` uniformly random ``[batch, seq]`` token batches from one generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(n)]


class Tokens(Dataset):
    """``n`` sequences with a learnable rule: each token is the previous one + 1 (mod ``vocab``) after a random
    start, with 10 % of the positions shifted by random noise."""

    def __init__(self, n: int, seed: int, *, vocab: int, seq: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        noise = (torch.rand(n, seq, generator=g) < 0.1) * torch.randint(0, vocab, (n, seq), generator=g)
        self.data = (start + torch.arange(seq) + noise) % vocab

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]
