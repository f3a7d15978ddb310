"""Sharded checkpoints of the host ledger through ``torch.distributed.checkpoint``, written atomically.

A checkpoint is a directory: DCP files holding every parameter's FP32 master and both Adam moments (one
tensor per parameter name, so a checkpoint loads on any number of ranks), and ``meta.pt`` (rank 0: Lightning's
loops, schedulers, optimizer hyper-parameters, the precision plugin's state, the step count and the module's
buffers). The ledger is shared by the ranks of a host, so each rank writes (and reads) a balanced share of
the parameters (with several hosts, each host's ranks split them again: every host's ledger is complete and
the checkpoint keeps one copy). With host-sharded ledgers each host writes its 1/N of every parameter as
rectangular chunks of the same tensors, so a checkpoint resumes with either host layout and any number of hosts
and ranks. Everything is written into a hidden sibling directory first; rank 0 swaps it into place only after
every rank finished, so an interrupted save leaves the previous checkpoint whole.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

log = logging.getLogger(__name__)

META = "meta.pt"
FORMAT = 1


def is_sharded(path: str | os.PathLike) -> bool:
    return Path(path).is_dir() and (Path(path) / META).is_file()


def share(sizes: dict[str, int], world_size: int) -> list[list[str]]:
    """Parameters per rank, largest first to the least loaded rank (deterministic, balanced by elements)."""
    load = [0] * world_size
    out: list[list[str]] = [[] for _ in range(world_size)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world_size), key=lambda i: (load[i], i))
        out[r].append(name)
        load[r] += sizes[name]
    return out


def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The row-major elements ``[start, stop)`` of a tensor of ``shape`` as rectangular boxes ``(offsets, sizes,
    first element)``, each contiguous in memory (at most ``2 * ndim - 1`` of them)."""
    if stop <= start:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,), start)] if shape else [((), (), 0)]
    inner = math.prod(shape[1:])
    out = []

    def within(row: int, a: int, b: int) -> None:
        out.extend(((row, *o), (1, *z), row * inner + f) for o, z, f in boxes(shape[1:], a, b))

    first, last = start // inner, stop // inner
    if first == last:
        within(first, start - first * inner, stop - first * inner)
        return out
    if start % inner:
        within(first, start % inner, inner)
        first += 1
    if last > first:
        out.append(((first, *[0] * (len(shape) - 1)), (last - first, *shape[1:]), first * inner))
    if stop % inner:
        within(last, 0, stop % inner)
    return out


def _job_size(engine) -> int:
    return engine.topology.world_size


def _mine(engine) -> list[str]:
    """The parameters this rank reads and writes: a balanced share of its host's (every host shares alike)."""
    sizes = {n: engine.layout.units[u].slots[s].numel for n, (u, s) in engine.state.named_slots().items()}
    index, count = engine.topology.checkpoint_share
    return share(sizes, count)[index]


def _host_chunks(engine, view: torch.Tensor, parts: list[tuple[int, int]]) -> torch.Tensor | None:
    """This host's elements of ``view`` (a whole parameter in a host-sharded ledger) as a tensor DCP writes and
    reads by chunk: the view itself when the host holds all of it, None when it holds none of it."""
    lo, hi = parts[engine.topology.host]
    if hi == lo:
        return None
    if hi - lo == view.numel():
        return view
    shape, flat = tuple(view.shape), view.reshape(-1)
    props = TensorProperties(
        dtype=view.dtype,
        layout=torch.strided,
        requires_grad=False,
        memory_format=torch.contiguous_format,
        pin_memory=False,
    )
    meta, local = [], []
    for host, (a, b) in enumerate(parts):
        owner = host * engine.topology.ranks_per_host + engine.topology.local_rank  # the same share on every host
        for offsets, sizes, first in boxes(shape, a, b):
            md = ShardMetadata(list(offsets), list(sizes), f"rank:{owner}/cpu")
            meta.append(md)
            if host == engine.topology.host:
                local.append(Shard(flat[first : first + math.prod(sizes)].view(sizes), md))
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, ShardedTensorMetadata(meta, view.shape, props), process_group=_job_group(engine)
    )


def _state(engine) -> dict[str, torch.Tensor]:
    """What this rank writes and reads: views of its share of the ledger's parameters and moments."""
    names = _mine(engine)
    views = engine.state.ledger_tensors(names)
    if not engine.topology.host_sharded:
        return views
    slots = engine.state.named_slots()
    out = {}
    for key, view in views.items():
        part = _host_chunks(engine, view, engine.state.host_parts(slots[key.split("/", 1)[1]]))
        if part is not None:
            out[key] = part
    return out


def _job_group(engine):
    """Every rank of the job (several hosts: each host's ledger is complete, its ranks split the work)."""
    return engine.topology.job_group


def _barrier(engine) -> None:
    if _job_size(engine) > 1:
        dist.barrier(group=_job_group(engine))


def _agree(engine, value: Any) -> Any:
    if _job_size(engine) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=_job_group(engine))
    return box[0]


def save(engine, checkpoint: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``checkpoint`` (Lightning's dict, without the tensors the ledger holds) and the ledger to ``path``."""
    path = Path(_agree(engine, str(path)))
    tmp = path.with_name(f".{path.name}.tmp-{_agree(engine, uuid.uuid4().hex[:8])}")
    engine.synchronize()
    dcp.save(_state(engine), checkpoint_id=tmp, process_group=_job_group(engine))
    if engine.topology.global_rank == 0:
        meta = {k: v for k, v in checkpoint.items() if k != "state_dict"}
        meta["slidedp"] = {
            "format": FORMAT,
            "step": engine.step,
            "world_size": _job_size(engine),
            "params": sorted(engine.state.named_slots()),
            "buffers": engine.state.buffers(),
            **_hf_configs(engine.model),
        }
        torch.save(meta, tmp / META)
    _barrier(engine)
    if engine.topology.global_rank == 0:
        _swap_in(tmp, path)
        log.info("SlideDP checkpoint (step %d, %d ranks) written to %s", engine.step, _job_size(engine), path)
    _barrier(engine)


def _hf_configs(model) -> dict[str, dict]:
    """A transformers model's config and generation config, so that the checkpoint exports on its own."""
    out = {}
    for key, attr in (("hf_config", "config"), ("generation_config", "generation_config")):
        value = getattr(model, attr, None)
        if hasattr(value, "to_dict"):
            out[key] = value.to_dict()
    return out


def _swap_in(tmp: Path, path: Path) -> None:
    """Put the finished ``tmp`` at ``path``; the previous checkpoint there goes only once it is replaced."""
    old = None
    if path.exists() or path.is_symlink():
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def load(engine, path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save` (with any number of ranks) into the ledger; returns Lightning's
    part of it."""
    path = Path(_agree(engine, str(path)))
    meta = torch.load(path / META, map_location="cpu", weights_only=False)
    info = meta.get("slidedp", {})
    if info.get("format") != FORMAT:
        raise ValueError(f"{path} is not a SlideDP checkpoint of format {FORMAT} (found {info.get('format')!r}).")
    have = sorted(engine.state.named_slots())
    if info["params"] != have:
        missing, unexpected = sorted(set(have) - set(info["params"])), sorted(set(info["params"]) - set(have))
        raise KeyError(
            f"checkpoint {path} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    engine.synchronize()
    engine.drop_resident()
    dcp.load(_state(engine), checkpoint_id=path, process_group=_job_group(engine))
    engine.restored(info["step"], info["buffers"])
    log.info(
        "SlideDP checkpoint %s (step %d, saved by %d ranks) loaded on %d ranks",
        path,
        info["step"],
        info["world_size"],
        _job_size(engine),
    )
    return meta
