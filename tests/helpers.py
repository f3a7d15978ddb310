"""Shared test helpers: tiny random decoder models, token data and the relative error the equivalence checks use.

Imported by the test modules and by ``tests/integration/job.py`` (a script, which puts the repository root on
``sys.path`` for it). Only torch and transformers: nothing here starts a process or touches a device.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
)

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


# -- tiny configs of many transformers families (the structural adapter's tests) ---------------------------

# per family: the arguments beyond the common tiny shape (64 wide, 4 query heads, 2 KV heads of 16, 2 layers)
FAMILY_ARGS: dict[str, dict] = {
    "qwen3": {},
    "qwen2": {},
    "llama": {},
    "mistral": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "gemma": {},
    "gemma2": {"sliding_window": 8, "query_pre_attn_scalar": 16},  # softcapping on, sliding/full alternating
    "gemma3_text": {
        "sliding_window": 8,
        "query_pre_attn_scalar": 16,
        "layer_types": ["sliding_attention", "full_attention"],  # hybrid: one rotary per layer type
    },
    "phi3": {},  # fused qkv_proj and gate_up_proj
    "olmo2": {},
    "granite": {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.25},
    "cohere": {"logit_scale": 0.5},
    "starcoder2": {"sliding_window": 8},  # LayerNorm, biases everywhere
    "stablelm": {"qk_layernorm": True, "use_parallel_residual": True},  # partial rotary
    "smollm3": {"no_rope_layer_interval": 2},  # every second layer without rotary
    "cohere2": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
    "qwen2_moe": {  # routed experts plus a gated shared expert
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
    },
    "deepseek_v3": {  # MLA attention; layer 0 dense, layer 1 MoE with a shared expert (layers of two shapes)
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "head_dim": 8,  # the rotary part of a query head
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
    },
    "gpt_oss": {  # attention sinks, sliding/full alternating, biased experts
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "sliding_window": 8,
    },
}
MOE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "deepseek_v3", "gpt_oss")


def family_config(
    family: str,
    tied: bool | None = None,
    layers: int = 2,
    *,
    vocab: int = VOCAB,
    max_positions: int = MAX_POSITIONS,
) -> PreTrainedConfig:
    """A tiny config of the transformers ``model_type`` ``family`` (one of ``FAMILY_ARGS`` or ``"gpt2"``): 64 wide,
    eager attention, token ids 0 (inside any vocabulary); MoE families return their router loss. ``tied`` None
    keeps the family's default."""
    if family != "gpt2" and family not in FAMILY_ARGS:
        raise ValueError(f"no tiny config for model_type {family!r}; known: {sorted(FAMILY_ARGS) + ['gpt2']}")
    if family == "gpt2":
        args: dict = {"n_embd": 64, "n_layer": layers, "n_head": 4, "n_positions": max_positions}
        args.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # deterministic, as the other families
    else:
        args = {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": max_positions,
        }
        args.update(FAMILY_ARGS[family])
        if family in MOE_FAMILIES:
            args.update(output_router_logits=True, router_aux_loss_coef=0.01)
    args.update(vocab_size=vocab, pad_token_id=0, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    if tied is not None:
        args["tie_word_embeddings"] = tied
    return AutoConfig.for_model(family, **args)


def family_model(family: str, seed: int = 0, tied: bool | None = None, layers: int = 2) -> PreTrainedModel:
    """The causal LM of ``family_config(family, tied, layers)`` with its weights drawn after ``torch.manual_seed``."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(family_config(family, tied, layers))


# -- a nanoGPT-style user model (no transformers): a block list, tied embedding and head ----------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in self.c_attn(x).split(c, dim=2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's layout: ``transformer`` = {wte, wpe, drop, h (the blocks), ln_f}, ``lm_head`` tied to ``wte``.
    ``head_first`` registers ``lm_head`` before ``transformer`` (LitGPT's order); ``tied=False`` unties it."""

    def __init__(
        self,
        layers: int = 2,
        width: int = 32,
        heads: int = 2,
        *,
        tied: bool = True,
        head_first: bool = False,
        vocab: int = VOCAB,
        max_positions: int = MAX_POSITIONS,
    ) -> None:
        super().__init__()
        if head_first:
            self.lm_head = nn.Linear(width, vocab, bias=False)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab, width),
                wpe=nn.Embedding(max_positions, width),
                drop=nn.Dropout(0.0),
                h=nn.ModuleList(Block(width, heads) for _ in range(layers)),
                ln_f=nn.LayerNorm(width),
            )
        )
        if not head_first:
            self.lm_head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.transformer.wte.weight

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = self.transformer
        x = t.drop(t.wte(idx) + t.wpe(torch.arange(idx.shape[1], device=idx.device)))
        for block in t.h:
            x = block(x)
        logits = self.lm_head(t.ln_f(x))
        if targets is None:
            return logits, None
        return logits, nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten())


def nanogpt(seed: int = 0, **kwargs) -> NanoGPT:
    """A tiny :class:`NanoGPT` drawn after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return NanoGPT(**kwargs)
