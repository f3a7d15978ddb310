"""Shared helpers of the runtime tests: one-process engines on a tiny Qwen3 and their torch references."""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

from slidedp_lightning.models import HFDecoderAdapter
from slidedp_lightning.runtime.activation_policy import ActivationPolicy
from slidedp_lightning.runtime.engine import EngineConfig, SlideDPEngine
from slidedp_lightning.runtime.layout import build_layout
from tests.helpers import (
    rel_err,
    tiny_model,
    token_batches,
)

SEQ, BATCH = 16, 2


SEQ, BATCH = 16, 2


CPU = torch.device("cpu")


def make_engine(model: nn.Module, **cfg) -> SlideDPEngine:
    return SlideDPEngine(model, EngineConfig(**cfg), device=CPU, compute_dtype=torch.float32)


def adamw_groups(model: nn.Module, lr: float = 3e-3, **kw) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        **kw,
    )


def batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    """``n`` random [BATCH, SEQ] token batches, the engine tests' data."""
    return token_batches(n, BATCH, SEQ, seed=seed)


def assert_rel_close(actual: dict, expected: dict, tol: float = 1e-5) -> None:
    assert actual.keys() == expected.keys()
    for k in expected:
        assert actual[k].shape == expected[k].shape, k
        err = rel_err(actual[k], expected[k])
        assert err <= tol, f"{k}: relative error {err:.3g} > {tol}"


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss


def train_pair(
    model: nn.Module, engine: SlideDPEngine, ref: nn.Module, opt, ref_opt, steps: int, lr_drop_at: int | None = None
) -> tuple[list[float], list[float]]:
    losses, ref_losses = [], []
    for i, x in enumerate(batches(steps)):
        if i == lr_drop_at:  # a scheduler changing lr between steps: read live at dispatch
            for o in (opt, ref_opt):
                for group in o.param_groups:
                    group["lr"] *= 0.5
        loss = loss_of(model, x)
        loss.backward()
        assert engine.end_step()
        losses.append(loss.item())
        ref_opt.zero_grad()
        ref_loss = loss_of(ref, x)
        ref_loss.backward()
        ref_opt.step()
        ref_losses.append(ref_loss.item())
    return losses, ref_losses


def layout_of(model: Qwen3ForCausalLM, world_size: int = 1):
    return build_layout(model, HFDecoderAdapter().units(model), world_size)


def aligned_model(layers: int = 3, seed: int = 0) -> Qwen3ForCausalLM:
    """A Qwen3 whose every parameter is a multiple of 16 elements and every unit a multiple of 1024: no padding,
    so bytes per parameter are the ledger's own."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=384,
        intermediate_size=768,
        num_hidden_layers=layers,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=128,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    return Qwen3ForCausalLM(config)


STEPS = 3


def train(policy, tied: bool = True, steps: int = STEPS):
    """Losses, final master weights and per-step accounting of a one-process engine run under ``policy``."""
    model = tiny_model(tied)
    engine = make_engine(model, activation_policy=ActivationPolicy.coerce(policy))
    try:
        engine.attach_optimizer(adamw_groups(model))
        losses, memory = [], []
        for x in batches(steps):
            loss = loss_of(model, x)
            loss.backward()
            assert engine.end_step()
            losses.append(loss.item())
            memory.append(engine.device_memory())
        return losses, engine.state_dict(), memory
    finally:
        engine.close()
