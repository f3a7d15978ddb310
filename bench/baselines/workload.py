"""What every system is given: model config, initial weights file, data, batch, sequence length, optimizer.

A :class:`JobSpec` is the whole description of one run; the systems may only read it, so two specs that agree
on :meth:`JobSpec.workload` train the same model on the same data with the same optimizer.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch.utils.data import Dataset

SYSTEMS = ("slidedp", "replicated", "ddp", "fsdp2", "fsdp2_offload", "zero_offload")
HYPER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}


@dataclass(frozen=True)
class ModelShape:
    """A Qwen3 decoder's shape, dense or Mixture-of-Experts (``experts > 0``: Qwen3-MoE); random init from a seed."""

    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = True
    experts: int = 0  # MoE: experts per block (each of width moe_intermediate), top experts_per_tok routed
    experts_per_tok: int = 2
    moe_intermediate: int = 0

    def hf_config(self, max_positions: int):
        from transformers import Qwen3Config, Qwen3MoeConfig

        common = dict(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=max_positions,
            tie_word_embeddings=self.tied,
            attn_implementation="sdpa",
        )
        if self.experts:
            return Qwen3MoeConfig(
                **common,
                num_experts=self.experts,
                num_experts_per_tok=self.experts_per_tok,
                moe_intermediate_size=self.moe_intermediate,
                output_router_logits=True,
            )
        return Qwen3Config(**common)

    def with_layers(self, layers: int) -> ModelShape:
        return replace(self, name=f"{self.name}-L{layers}", layers=layers)

    @property
    def num_params(self) -> int:
        """Parameters of the causal LM with this shape (norms and MoE routers included)."""
        h, d = self.hidden, self.head_dim
        attn = h * self.heads * d * 2 + h * self.kv_heads * d * 2 + 2 * d
        mlp = self.experts * (h + 3 * h * self.moe_intermediate) if self.experts else 3 * h * self.intermediate
        block = attn + mlp + 2 * h
        return self.vocab * h * (1 if self.tied else 2) + self.layers * block + h


@dataclass(frozen=True)
class JobSpec:
    """One run of one system. ``system`` and ``knobs`` are how it runs; everything else is the workload."""

    system: str
    model: ModelShape
    ranks: int
    global_batch: int
    seq: int
    steps: int
    warmup: int
    precision: str = "32-true"
    checkpointing: bool = True  # full-layer activation checkpointing (recompute each block in backward)
    hyper: dict = field(default_factory=lambda: dict(HYPER))
    init_file: str = ""
    data_seed: int = 7
    accelerator: str = "cpu"
    knobs: dict = field(default_factory=dict)  # system-specific (routes, chunks, activation policy)
    timeout_s: float = 300.0
    # a save_pretrained directory to load instead of init_file (SlideDP: slidedp_lightning.from_pretrained)
    checkpoint_dir: str = ""
    save: bool = False  # after the steps: save a checkpoint (model + optimizer) into <out>/checkpoint
    export: bool = False  # SlideDP: then a Hugging Face export into <out>/export

    def __post_init__(self) -> None:
        if self.system not in SYSTEMS:
            raise ValueError(f"unknown system {self.system!r}; one of {SYSTEMS}")
        if self.global_batch % self.ranks:
            raise ValueError(f"global batch {self.global_batch} is not divisible by {self.ranks} ranks")
        if self.steps < self.warmup + 2:
            raise ValueError("steps must leave at least two measured step intervals after the warm-up")

    @property
    def batch_per_rank(self) -> int:
        return self.global_batch // self.ranks

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq

    def workload(self) -> dict:
        """Everything that must be equal between systems compared in one table."""
        return {
            "model": asdict(self.model),
            "global_batch": self.global_batch,
            "seq": self.seq,
            "steps": self.steps,
            "warmup": self.warmup,
            "precision": self.precision,
            "checkpointing": self.checkpointing,
            "hyper": {k: list(v) if isinstance(v, tuple) else v for k, v in self.hyper.items()},
            "init_file": self.init_file,
            "checkpoint_dir": self.checkpoint_dir,
            "data_seed": self.data_seed,
        }

    def to_json(self) -> str:
        d = asdict(self)
        d["hyper"] = self.workload()["hyper"]
        return json.dumps(d)

    @staticmethod
    def from_dict(d: dict) -> JobSpec:
        d = dict(d)
        d["model"] = ModelShape(**d["model"])
        return JobSpec(**d)

    def with_(self, **kw) -> JobSpec:
        return replace(self, **kw)


def init_file_for(shape: ModelShape, seq: int, root: Path, seed: int = 1234) -> Path:
    """The initial weights of ``shape`` (built once from ``seed``), saved for every system to load."""
    key = hashlib.sha1(json.dumps([asdict(shape), seq, seed]).encode()).hexdigest()[:12]
    path = root / f"init-{shape.name}-{key}.pt"
    if not path.exists():
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(shape.hf_config(seq))
        root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(model.state_dict(), tmp)
        tmp.rename(path)
    return path


def build_model(spec: JobSpec, device: str | torch.device = "cpu"):
    """The model with the spec's initial weights (loaded from ``init_file``, or from ``checkpoint_dir``)."""
    from transformers import AutoModelForCausalLM

    if spec.checkpoint_dir:
        return AutoModelForCausalLM.from_pretrained(
            spec.checkpoint_dir, dtype=torch.float32, device_map=None, local_files_only=True
        ).to(device)

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(spec.model.hf_config(spec.seq))
    state = torch.load(spec.init_file, mmap=True, weights_only=True)
    model.load_state_dict(state)
    del state
    return model


class Tokens(Dataset):
    """``n`` sequences with a learnable rule (token = previous + 1 mod vocab, 10 % noise) from a seed."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        noise = (torch.rand(n, seq, generator=g) < 0.1) * torch.randint(0, vocab, (n, seq), generator=g)
        self.data = (start + torch.arange(seq) + noise) % vocab

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


def dataset(spec: JobSpec) -> Tokens:
    """The whole run's data: ``steps x global_batch`` sequences, split over ranks by ``DistributedSampler``
    (interleaved, no shuffle) in every system."""
    return Tokens(spec.steps * spec.global_batch, spec.seq, spec.model.vocab, spec.data_seed)


def rank_loader(spec: JobSpec, rank: int):
    """This rank's batches, exactly as Lightning's distributed sampler splits them."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    data = dataset(spec)
    sampler = DistributedSampler(data, num_replicas=spec.ranks, rank=rank, shuffle=False)
    return DataLoader(data, batch_size=spec.batch_per_rank, sampler=sampler, shuffle=False)


def adamw_groups(model: torch.nn.Module, hyper: dict) -> list[dict]:
    """One param group, every parameter decayed (the same for every system)."""
    return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": hyper["weight_decay"]}]
