"""Hugging Face export: a ``save_pretrained`` directory (safetensors + config), straight from the host ledger
or, offline, from a distributed checkpoint (any host layout).

The weights never go through a device or a whole-model copy: one safetensors shard at a time is converted
from the FP32 master (BF16 or FP32) and written by global rank 0 (offline: read from the checkpoint shard by
shard); a tied weight is written once, under its first name, as ``save_pretrained`` does.

Offline: ``python -m slidedp_lightning.export CHECKPOINT_DIR OUT_DIR [--dtype bf16|fp32] [--config HF_DIR]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"export dtype must be bfloat16 or float32, got {dtype!r}.")
    return dtype


def write_hf(
    directory: str | os.PathLike,
    meta: dict[str, torch.Tensor],
    read: Callable[[list[str]], dict[str, torch.Tensor]],
    config,
    generation,
    dtype: torch.dtype,
    max_shard_size: str | int,
) -> None:
    """Write the tensors named by ``meta`` (shape and dtype only) one shard at a time, each shard's tensors
    fetched by ``read(names)``, then the config (and generation config, if any)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)

    def target(t: torch.Tensor) -> torch.dtype:
        return dtype if t.is_floating_point() else t.dtype

    meta = {n: torch.empty(t.shape, dtype=target(t), device="meta") for n, t in meta.items()}
    split = split_torch_state_dict_into_shards(
        meta, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    for filename, names in split.filename_to_tensors.items():
        tensors = read(names)
        shard = {n: tensors[n].to(meta[n].dtype, copy=True).contiguous() for n in names}
        save_file(shard, str(directory / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {
            "metadata": {"total_size": sum(m.numel() * m.element_size() for m in meta.values())},
            "weight_map": split.tensor_to_filename,
        }
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(directory)
    settings = json.loads((directory / "config.json").read_text())
    settings["torch_dtype" if "torch_dtype" in settings else "dtype"] = str(dtype).removeprefix("torch.")
    (directory / "config.json").write_text(json.dumps(settings, indent=2))
    if generation is not None:
        generation.save_pretrained(directory)
    log.info(
        "SlideDP: Hugging Face export (%s, %d file(s)) written to %s", dtype, len(split.filename_to_tensors), directory
    )


def save_hf(
    engine, directory: str | os.PathLike, dtype: str | torch.dtype = torch.bfloat16, max_shard_size: str | int = "5GB"
) -> None:
    """Write ``directory`` so that ``AutoModelForCausalLM.from_pretrained(directory)`` loads the trained weights."""
    dtype = _dtype(dtype)
    if not hasattr(engine.model, "config") or not hasattr(engine.model.config, "save_pretrained"):
        raise TypeError(f"{type(engine.model).__name__} has no Hugging Face config to export with.")
    engine.state.require_whole_parameters("save_hf")
    engine.synchronize()
    if engine.topology.global_rank == 0:
        tensors = engine.state.model_tensors(engine.model)
        write_hf(
            directory,
            tensors,
            lambda names: tensors,
            engine.model.config,
            getattr(engine.model, "generation_config", None),
            dtype,
            max_shard_size,
        )
    if engine.topology.job_group is not None:
        dist.barrier(group=engine.topology.job_group)


def export_checkpoint(
    checkpoint: str | os.PathLike,
    directory: str | os.PathLike,
    dtype: str | torch.dtype = torch.bfloat16,
    max_shard_size: str | int = "5GB",
    config: str | os.PathLike | None = None,
) -> None:
    """Write a ``save_pretrained`` directory from a distributed SlideDP checkpoint, in one process, without the
    training job: one shard's tensors are read from the checkpoint at a time (whatever host layout, number of
    hosts or ranks saved it). ``config``: a Hugging Face model directory or ``config.json``, needed only when the
    checkpoint does not carry the model's config."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from slidedp_lightning import checkpoint as sharded

    dtype = _dtype(dtype)
    checkpoint = Path(checkpoint)
    if not sharded.is_sharded(checkpoint):
        raise FileNotFoundError(f"{checkpoint} is not a SlideDP distributed checkpoint directory (no {sharded.META}).")
    info = sharded.read_meta(checkpoint)["slidedp"]
    if config is not None:
        hf_config = AutoConfig.from_pretrained(Path(config).parent if Path(config).is_file() else config)
    elif info.get("hf_config"):
        settings = dict(info["hf_config"])
        hf_config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    else:
        raise ValueError(f"{checkpoint} does not carry a Hugging Face config: pass config=<model dir>.")
    generation = GenerationConfig.from_dict(info["generation_config"]) if info.get("generation_config") else None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    first = next(iter(model.state_dict()))
    found = [c for c in sorted(set(info["params"]) | set(info["buffers"])) if c == first or c.endswith("." + first)]
    if len(found) != 1:
        raise KeyError(
            f"{checkpoint} does not hold {first!r} once (found {found}): was it saved from a {type(model).__name__}?"
        )
    prefix = found[0][: len(found[0]) - len(first)]
    meta, seen = {}, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue  # the second name of a tied weight: written once, under the first
        seen.add(id(t))
        key = prefix + name
        if key in info["params"]:
            meta[name] = torch.empty(tuple(info["params"][key]), dtype=torch.float32, device="meta")
        elif key in info["buffers"]:
            meta[name] = info["buffers"][key]
        else:
            raise KeyError(f"{checkpoint} has no tensor for {key!r}: was it saved from a {type(model).__name__}?")
    missing = sorted(set(info["params"]) - {prefix + n for n in meta})
    if missing:
        raise KeyError(f"{checkpoint} holds parameters the {type(model).__name__} does not have: {missing[:5]}")

    def read(shard: list[str]) -> dict[str, torch.Tensor]:
        params = {n: torch.empty(meta[n].shape) for n in shard if prefix + n in info["params"]}
        wanted = [(f"model/{prefix}{n}", 0, t.numel(), t.view(-1)) for n, t in params.items()]
        with warnings.catch_warnings():  # one process reading on purpose
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            sharded.read_ranges(checkpoint, [w for w in wanted if w[2]], no_dist=True)
        return {**params, **{n: meta[n] for n in shard if n not in params}}

    write_hf(directory, meta, read, hf_config, generation, dtype, max_shard_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slidedp_lightning.export", description=export_checkpoint.__doc__)
    parser.add_argument("checkpoint", help="a SlideDP distributed checkpoint directory")
    parser.add_argument("out", help="the save_pretrained directory to write")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--max-shard-size", default="5GB")
    parser.add_argument("--config", help="Hugging Face model directory or config.json (if the checkpoint has none)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    export_checkpoint(args.checkpoint, args.out, args.dtype, args.max_shard_size, args.config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
