"""A training step's work, unit by unit, from a decoder-only transformers config.

Units follow the runtime (``slidedp_lightning.models``): the embedding, one unit per decoder block, and a
final unit (final norm, plus ``lm_head`` when it is not tied; a tied head borrows the embedding unit).
FLOPs are per token of forward; backward is ``bwd_fwd_ratio`` (profile) times forward.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

SHIPPED = {
    "qwen3-1.7b": ("slidedp_lightning.steptime", "configs/qwen3_1_7b.json"),
    "qwen3-8b": ("slidedp_lightning.steptime", "configs/qwen3_8b.json"),
    "qwen3-14b": ("slidedp_lightning.steptime", "configs/qwen3_14b.json"),
    "qwen3-tiny": ("slidedp_lightning.recipes", "configs/qwen3_tiny.json"),
}
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
ACTIVATION_POLICIES = ("none", "full")
# Activation bytes a decoder block keeps per token without checkpointing, in units of hidden (BF16, fused
# attention): inputs of the 4 projections, norms, residuals and attention output (~34 h with dropout-free
# fused kernels, Korthikanti et al. 2022 without the attention-matrix term).
RETAINED_PER_TOKEN_HIDDEN = 34


@dataclass(frozen=True)
class ModelShape:
    """The few fields of a decoder-only config the model needs."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    tied: bool
    name: str = "model"

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], name: str = "model") -> ModelShape:
        moe = [k for k in MOE_KEYS if cfg.get(k)]
        if moe:
            raise ValueError(f"{name}: mixture-of-experts configs ({', '.join(moe)}) are not modelled yet")
        missing = [
            k
            for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
            if k not in cfg
        ]
        if missing:
            raise ValueError(f"{name}: not a decoder-only transformers config (missing {missing})")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            hidden=hidden,
            intermediate=int(cfg["intermediate_size"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            layers=int(cfg["num_hidden_layers"]),
            vocab=int(cfg["vocab_size"]),
            tied=bool(cfg.get("tie_word_embeddings", False)),
            name=name,
        )

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder block (Qwen3: q/k norms of head_dim, two RMSNorms, no biases)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate + 2 * h + 2 * self.head_dim

    def layer_matmul_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate

    @property
    def total_params(self) -> int:
        return sum(u.params for u in units(self, seq=1))


def load_config(model: str | Path | dict | Any) -> ModelShape:
    """A shipped name (``qwen3-1.7b``, ``qwen3-8b``, ``qwen3-14b``, ``qwen3-tiny``), a config JSON, a checkpoint directory
    holding ``config.json``, a dict, or a transformers ``PretrainedConfig``."""
    if isinstance(model, dict):
        return ModelShape.from_dict(model)
    if hasattr(model, "to_dict"):
        return ModelShape.from_dict(model.to_dict(), getattr(model, "model_type", "model"))
    key = str(model)
    if key.lower() in SHIPPED:
        package, rel = SHIPPED[key.lower()]
        return ModelShape.from_dict(json.loads(resources.files(package).joinpath(rel).read_text()), key.lower())
    path = Path(key)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"model config {key!r}: no such file (give a config JSON, a checkpoint directory "
            f"with config.json, or one of {sorted(SHIPPED)})"
        )
    return ModelShape.from_dict(
        json.loads(path.read_text()), path.parent.name if path.name == "config.json" else path.stem
    )


@dataclass(frozen=True)
class UnitActivation:
    """How one unit keeps its activations (the input P5's policies extend).

    ``recompute_fraction``: share of the unit's forward FLOPs recomputed in backward; ``retained_bytes_per_token``:
    activation bytes kept from forward to backward; ``offload_ratio``: share of those moved to the host and
    reloaded (the offload lane).
    """

    recompute_fraction: float = 0.0
    retained_bytes_per_token: float = 0.0
    offload_ratio: float = 0.0

    def __post_init__(self) -> None:
        for name in ("recompute_fraction", "offload_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


def activation_policy(name: str, shape: ModelShape, act_bytes: int = 2) -> UnitActivation:
    """The per-block activation plan of a named policy: ``none`` (keep all) or ``full`` (keep the input, recompute)."""
    if name == "none":
        return UnitActivation(0.0, RETAINED_PER_TOKEN_HIDDEN * shape.hidden * act_bytes / 2, 0.0)
    if name == "full":
        return UnitActivation(1.0, shape.hidden * act_bytes, 0.0)
    raise ValueError(f"unknown activation policy {name!r}; choose one of {ACTIVATION_POLICIES}")


@dataclass(frozen=True)
class Unit:
    """One streamed unit: parameters, forward FLOPs per token, activations, and which units its compute borrows."""

    name: str
    params: int
    fwd_flops_per_token: float
    activation: UnitActivation = field(default_factory=UnitActivation)
    borrows: tuple[int, ...] = ()  # other units whose parameters this unit's compute needs (tied head)
    matrices: tuple[int, ...] = ()  # elements of each weight matrix (each its own gradient tensor in backward)


def units(
    shape: ModelShape, seq: int, activation: str | UnitActivation | list[UnitActivation] = "full", act_bytes: int = 2
) -> list[Unit]:
    """Units in forward order. ``activation``: a policy name, one plan for every block, or one plan per block."""
    if isinstance(activation, str):
        plans = [activation_policy(activation, shape, act_bytes)] * shape.layers
    elif isinstance(activation, UnitActivation):
        plans = [activation] * shape.layers
    else:
        plans = list(activation)
        if len(plans) != shape.layers:
            raise ValueError(f"{len(plans)} activation plans for {shape.layers} decoder blocks")
    h = shape.hidden
    # causal attention: QK^T and AV, 2 FLOPs per MAC, half of the S x S scores
    attn = 2 * 2 * seq * shape.heads * shape.head_dim * 0.5
    layer_flops = 2 * shape.layer_matmul_params() + attn
    head_flops = 2 * h * shape.vocab
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    block = (h * q, h * kv, h * kv, q * h) + (h * shape.intermediate,) * 3
    out = [Unit("embed", shape.vocab * h, 0.0, matrices=(shape.vocab * h,))]
    out += [Unit(f"layer{i}", shape.layer_params, layer_flops, plans[i], matrices=block) for i in range(shape.layers)]
    final_params = h + (0 if shape.tied else shape.vocab * h)
    out.append(
        Unit(
            "head",
            final_params,
            head_flops,
            UnitActivation(),
            (0,) if shape.tied else (),
            () if shape.tied else (shape.vocab * h,),
        )
    )
    return out
