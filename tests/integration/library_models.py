"""Tiny models from other libraries, built by name the way each library's docs build them, and their LM loss.

Used by the integration job (``JobConfig.library``) and by tests/models/test_libraries.py. Each library is imported
inside its builder only, so this module imports without any of them; :func:`available` tells which are installed
(docs/models.md, "Models from other libraries", has the install commands). Every model is 2 layers, 64 wide, with the
caller's vocabulary and sequence length; its weights are drawn from torch's global generator (seed it first).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

WIDTH, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 128, 2


def _litgpt(name: str, vocab: int, seq: int, **shape) -> nn.Module:
    from litgpt.config import Config
    from litgpt.model import GPT

    args = dict(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, head_size=WIDTH // HEADS, intermediate_size=FFN)
    config = Config.from_name(name, **args, vocab_size=vocab, padded_vocab_size=vocab, block_size=seq, **shape)
    return GPT(config)


def litgpt_llama(vocab: int, seq: int) -> nn.Module:
    """LitGPT's Llama 3.2 1B layout (RMSNorm, LLaMAMLP, GQA, scaled RoPE, no biases), shrunk."""
    return _litgpt("Llama-3.2-1B", vocab, seq, n_query_groups=KV_HEADS)


def litgpt_pythia(vocab: int, seq: int) -> nn.Module:
    """LitGPT's Pythia layout (GPT-NeoX: parallel residual, LayerNorm, biases, partial rotary), shrunk."""
    return _litgpt("pythia-14m", vocab, seq, n_query_groups=HEADS)


def torchtune_llama3(vocab: int, seq: int) -> nn.Module:
    """torchtune's ``llama3`` component builder: a ``TransformerDecoder`` with its own output projection."""
    from torchtune.models.llama3 import llama3

    return llama3(
        vocab_size=vocab,
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        embed_dim=WIDTH,
        max_seq_len=seq,
        intermediate_dim=FFN,
    )


def torchtune_llama3_2_tied(vocab: int, seq: int) -> nn.Module:
    """torchtune's ``llama3_2`` builder with tied embeddings: the output is a ``TiedLinear``, a plain object holding
    the token embedding (no ``nn.Module``, no parameter of its own)."""
    from torchtune.models.llama3_2 import llama3_2

    return llama3_2(
        vocab_size=vocab,
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        embed_dim=WIDTH,
        max_seq_len=seq,
        intermediate_dim=FFN,
        tie_word_embeddings=True,
    )


def torchtitan_llama3(vocab: int, seq: int) -> nn.Module:
    """torchtitan's own Llama 3 (blocks in an ``nn.ModuleDict`` keyed "0", "1", ...), with SDPA attention: 0.3's
    language-model backends (flex, varlen) compile kernels, SDPA runs anywhere."""
    import torchtitan.models.llama3 as titan

    if hasattr(titan, "TransformerModelArgs"):  # torchtitan 0.2: model args, SDPA by default, init_weights()
        args = titan.TransformerModelArgs(
            dim=WIDTH, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS, vocab_size=vocab, max_seq_len=seq
        )
        model = titan.Transformer(args)
        model.init_weights()
        return model
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention

    # torchtitan 0.3: the debug model's config (torchtitan/models/llama3/__init__.py), shrunk
    layers = titan._build_llama3_layers(
        n_layers=LAYERS,
        dim=WIDTH,
        n_heads=HEADS,
        n_kv_heads=KV_HEADS,
        hidden_dim=compute_ffn_hidden_dim(WIDTH, multiple_of=32),
        rope=ComplexRoPE.Config(dim=WIDTH // HEADS, max_seq_len=seq, theta=500000, scaling="llama"),
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = titan.Llama3Model.Config(
        dim=WIDTH,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=WIDTH, param_init=titan._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=WIDTH, param_init=titan._NORM_INIT),
        lm_head=Linear.Config(in_features=WIDTH, out_features=vocab, param_init=titan._output_linear_init(WIDTH)),
        layers=layers,
    )
    model = config.build()
    model.init_states()
    return model


def nanogpt(vocab: int, seq: int) -> nn.Module:
    """The hand-written nanoGPT of tests/helpers.py (tied ``wte``/``lm_head``, biases, learned positions)."""
    from tests.helpers import NanoGPT

    return NanoGPT(width=WIDTH, heads=HEADS, vocab=vocab, max_positions=seq)


def peft_lora_qwen3(vocab: int, seq: int) -> nn.Module:
    """``peft.get_peft_model`` with LoRA on every attention projection of a tiny transformers Qwen3."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3ForCausalLM

    from tests.helpers import tiny_config

    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return get_peft_model(Qwen3ForCausalLM(tiny_config(False, LAYERS, vocab=vocab, max_positions=seq)), lora)


def _logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens)


def _hf_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens).logits


def _nanogpt_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens)[0]


@dataclass(frozen=True)
class Library:
    """One library's model: the module whose absence skips it, its builder and how its forward gives logits."""

    module: str  # imported by the builder; pytest.importorskip(module) where it is absent
    build: Callable[[int, int], nn.Module]  # (vocab, seq) -> model
    block: str  # the class of the library's decoder block: SlideDP streams one at a time
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor] = _logits
    # the name ending of a fused [q | k | v] attention bias (WIDTH each). Its key part shifts every score of a query
    # by the same amount, which softmax ignores: its gradient is zero but for rounding, and Adam turns that noise
    # into full-size steps, so two exact implementations part there (and only there) within a few steps
    key_bias: str | None = None

    def key_bias_slice(self, name: str) -> slice | None:
        """The key part of parameter ``name`` when it is the fused attention bias, else None."""
        return slice(WIDTH, 2 * WIDTH) if self.key_bias and name.endswith(self.key_bias) else None


LIBRARIES: dict[str, Library] = {
    "litgpt_llama": Library("litgpt", litgpt_llama, "Block"),
    "litgpt_pythia": Library("litgpt", litgpt_pythia, "Block", key_bias="attn.qkv.bias"),
    "torchtune_llama3": Library("torchtune", torchtune_llama3, "TransformerSelfAttentionLayer"),
    "torchtune_llama3_2_tied": Library("torchtune", torchtune_llama3_2_tied, "TransformerSelfAttentionLayer"),
    "torchtitan_llama3": Library("torchtitan", torchtitan_llama3, "Llama3TransformerBlock"),
    "nanogpt": Library("torch", nanogpt, "Block", _nanogpt_logits, key_bias="attn.c_attn.bias"),
    "peft_lora_qwen3": Library("peft", peft_lora_qwen3, "Qwen3DecoderLayer", _hf_logits),
}


def available(name: str) -> bool:
    """Whether the library that model ``name`` needs is installed."""
    return importlib.util.find_spec(LIBRARIES[name].module) is not None


def build(name: str, vocab: int, seq: int, seed: int | None = None) -> nn.Module:
    """Model ``name`` at this vocabulary and sequence length (weights after ``torch.manual_seed(seed)`` if given)."""
    if seed is not None:
        torch.manual_seed(seed)
    return LIBRARIES[name].build(vocab, seq)


def lm_loss(name: str, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of model ``name`` on ``tokens`` (every position predicts the following one)."""
    logits = LIBRARIES[name].logits(model, tokens).float()
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


NAMES = tuple(LIBRARIES)
