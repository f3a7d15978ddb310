"""Hugging Face export straight from the host ledger: a ``save_pretrained`` directory (safetensors + config).

The weights never go through a device or a whole-model copy: one safetensors shard at a time is converted
from the FP32 master (BF16 or FP32) and written by global rank 0; a tied weight is written once, under its
first name, as ``save_pretrained`` does.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}


def _tensors(engine) -> dict[str, torch.Tensor]:
    """The streamed model's state, keyed as its own ``state_dict()``: ledger views (tied weights once) and buffers."""
    out, seen = {}, set()
    for name, t in engine.model.state_dict(keep_vars=True).items():
        where = engine._slot_of.get(id(t))
        if where is None:
            out[name] = t.detach()
        elif where not in seen:
            seen.add(where)
            out[name] = engine.master_view(*where)
    return out


def save_hf(engine, directory: str | os.PathLike, dtype: str | torch.dtype = torch.bfloat16,
            max_shard_size: str | int = "5GB") -> None:  # fmt: skip
    """Write ``directory`` so that ``AutoModelForCausalLM.from_pretrained(directory)`` loads the trained weights."""
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"export dtype must be bfloat16 or float32, got {dtype!r}.")
    if not hasattr(engine.model, "config") or not hasattr(engine.model.config, "save_pretrained"):
        raise TypeError(f"{type(engine.model).__name__} has no Hugging Face config to export with.")
    engine._refuse_host_sharded("save_hf")
    engine.synchronize()
    if engine.global_rank == 0:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = _tensors(engine)

        def target(t: torch.Tensor) -> torch.dtype:
            return dtype if t.is_floating_point() else t.dtype

        meta = {n: torch.empty(t.shape, dtype=target(t), device="meta") for n, t in tensors.items()}
        split = split_torch_state_dict_into_shards(meta, filename_pattern="model{suffix}.safetensors",
                                                   max_shard_size=max_shard_size)  # fmt: skip
        for filename, names in split.filename_to_tensors.items():
            shard = {n: tensors[n].to(target(tensors[n]), copy=True).contiguous() for n in names}
            save_file(shard, str(directory / filename), metadata={"format": "pt"})
        if split.is_sharded:
            index = {"metadata": {"total_size": sum(m.numel() * m.element_size() for m in meta.values())},
                     "weight_map": split.tensor_to_filename}  # fmt: skip
            (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config = engine.model.config
        config.save_pretrained(directory)
        settings = json.loads((directory / "config.json").read_text())
        settings["torch_dtype" if "torch_dtype" in settings else "dtype"] = str(dtype).removeprefix("torch.")
        (directory / "config.json").write_text(json.dumps(settings, indent=2))
        generation = getattr(engine.model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(directory)
        log.info("SlideDP: Hugging Face export (%s, %d file(s)) written to %s", dtype, len(split.filename_to_tensors),
                 directory)  # fmt: skip
    if engine.hosts.count > 1:
        dist.barrier(group=engine.hosts.world)
    elif engine.world_size > 1:
        dist.barrier(group=engine.group)
