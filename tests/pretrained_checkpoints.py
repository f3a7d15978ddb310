"""Tiny ``save_pretrained`` checkpoints of a Qwen3 in several safetensors shards, and what transformers reads from
them: the pretrained-loading and export tests share these."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from tests.helpers import tiny_config

VOCAB = 64


def config(tied: bool, layers: int = 2) -> Qwen3Config:
    return tiny_config(tied, layers, vocab=VOCAB, max_positions=32)  # type: ignore[return-value]


def save(directory: Path, tied: bool, dtype: torch.dtype, seed: int = 0, shard: str = "60KB") -> Path:
    """A save_pretrained checkpoint of a tiny Qwen3 in ``dtype``, in several safetensors shards."""
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config(tied)).to(dtype)
    with torch.no_grad():  # norms away from 1, so a norm read from the wrong tensor shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory, max_shard_size=shard)
    return directory


def reference(directory: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True)
    return model.state_dict()


def index_of(directory: Path) -> dict:
    return json.loads((directory / "model.safetensors.index.json").read_text())
