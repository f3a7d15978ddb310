"""A random BF16 Qwen3 checkpoint of any depth, written shard by shard and never whole in memory.

Every layer is a safetensors file of its own (drawn from a seed of its own), so a checkpoint of ``L`` layers is a
directory of its ``config.json``, an index and links to the first ``L`` layer files: the capacity benchmark's
bisection over depths writes each layer once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.baselines.workload import ModelShape

STD = 0.02


def _draw(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * STD).to(torch.bfloat16)


def _layer_tensors(shape: ModelShape, i: int, seed: int) -> dict[str, torch.Tensor]:
    h, d = shape.hidden, shape.head_dim
    p = f"model.layers.{i}."
    mats = {
        "self_attn.q_proj.weight": (shape.heads * d, h),
        "self_attn.k_proj.weight": (shape.kv_heads * d, h),
        "self_attn.v_proj.weight": (shape.kv_heads * d, h),
        "self_attn.o_proj.weight": (h, shape.heads * d),
        "mlp.gate_proj.weight": (shape.intermediate, h),
        "mlp.up_proj.weight": (shape.intermediate, h),
        "mlp.down_proj.weight": (h, shape.intermediate),
    }
    out = {p + name: _draw(dims, seed * 1000 + 17 * i + k) for k, (name, dims) in enumerate(mats.items())}
    ones = {"self_attn.q_norm.weight": d, "self_attn.k_norm.weight": d}
    ones |= {"input_layernorm.weight": h, "post_attention_layernorm.weight": h}
    out |= {p + name: torch.ones(n, dtype=torch.bfloat16) for name, n in ones.items()}
    return out


class ShardedCheckpoints:
    """Checkpoints of ``shape`` with any number of layers under ``root`` (shards in ``root/shards``)."""

    def __init__(self, root: Path, shape: ModelShape, seq: int, seed: int = 1234) -> None:
        if shape.experts or not shape.tied:
            raise ValueError("the sharded checkpoints are of dense Qwen3 models with tied embeddings")
        self.root, self.shape, self.seq, self.seed = Path(root), shape, seq, seed
        self.shards = self.root / "shards"

    def _shard(self, name: str, make) -> Path:
        path = self.shards / name
        if not path.exists():
            self.shards.mkdir(parents=True, exist_ok=True)
            tensors = make()
            tmp = path.with_suffix(".tmp")
            save_file(tensors, str(tmp), metadata={"format": "pt"})
            os.replace(tmp, path)
        return path

    def directory(self, layers: int) -> Path:
        """The checkpoint of ``layers`` layers (its shards written on first use)."""
        shape = self.shape
        files = {
            "embed.safetensors": lambda: {"model.embed_tokens.weight": _draw((shape.vocab, shape.hidden), self.seed)}
        }
        files["norm.safetensors"] = lambda: {"model.norm.weight": torch.ones(shape.hidden, dtype=torch.bfloat16)}
        for i in range(layers):
            files[f"layer{i:03d}.safetensors"] = lambda i=i: _layer_tensors(shape, i, self.seed)
        out = self.root / f"L{layers}"
        if (out / "config.json").exists():
            return out
        tmp = self.root / f".L{layers}.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        weight_map, total = {}, 0
        for name, make in files.items():
            path = self._shard(name, make)
            link = tmp / name
            if not link.exists():
                os.symlink(os.path.relpath(path, out), link)
            with open(path, "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            for key, info in header.items():
                if key != "__metadata__":
                    weight_map[key] = name
                    total += info["data_offsets"][1] - info["data_offsets"][0]
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        config = shape.with_layers(layers).hf_config(self.seq)
        config.torch_dtype = "bfloat16"
        config.save_pretrained(tmp)
        os.replace(tmp, out)
        return out
