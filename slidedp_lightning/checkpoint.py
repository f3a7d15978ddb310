"""Sharded checkpoints of the host ledger through ``torch.distributed.checkpoint``, written atomically.

A checkpoint (format 2) is a directory:

- DCP files holding every parameter's FP32 master and both Adam moments (a wholly frozen unit has no moments,
  and without a master its weights come from its BF16 copy) as plain 1-D tensors, each a piece of
  the flattened tensor under ``<kind>/<name>@<start>-<stop>`` (its elements ``[start, stop)``). The ledger is
  shared by the ranks of a host, so each rank writes (and reads) a balanced share of the parameters (with
  several hosts, each host's ranks split them again: every host's ledger is complete and the checkpoint keeps
  one copy). With host-sharded ledgers each host writes its elements of each of those parameters as one
  piece. A rank that loads reads from the pieces that overlap what it holds, whatever layout, number of
  hosts and of ranks wrote them (a custom DCP ``LoadPlanner`` of element ranges: public API only);
- ``meta.json`` (rank 0): Lightning's loops, callbacks, schedulers, optimizer hyper-parameters and precision
  state, and the SlideDP header (format, step count, parameter shapes, the module's buffers, the Hugging Face
  config), as JSON; the tensors among them are in ``meta.safetensors``, referred to by name.

Loading one runs no code of the checkpoint's: the metadata is JSON and safetensors, DCP's tensor data is read
with ``torch.load(weights_only=True)``, and DCP's own pickled ``.metadata`` is checked to hold only DCP's
records before DCP unpickles it (:class:`~slidedp_lightning.runtime.compat.CheckedFileSystemReader`). What of
Lightning's checkpoint has no such form (an arbitrary object in a callback's state or the hyper-parameters)
is refused at save. Everything is written into a hidden sibling directory first; rank 0 swaps it into place
only after every rank finished, so an interrupted save leaves the previous checkpoint whole. The hidden directories
are named after global rank 0's process (``.<name>.tmp-<host>-<pid>-<start time>-<random>``): one that a killed
save left behind is removed by the next save to the same path once that process is gone (never one of a live
process, nor one written from another host, whose processes this one cannot see). A path that is a symbolic link
is written at the link's target, as a file written through a link would be: the link stays and names the new
checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch.distributed.checkpoint import LoadPlan, LoadPlanner, ReadItem, TensorStorageMetadata
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType

from slidedp_lightning.checkpoint_json import CheckpointContentError, decode, encode
from slidedp_lightning.runtime.compat import CheckedFileSystemReader
from slidedp_lightning.runtime.host_os import format_bytes, process_start_time

log = logging.getLogger(__name__)

META = "meta.json"
TENSORS = "meta.safetensors"
LEGACY_META = "meta.pt"  # format 1: the metadata pickled
FORMAT = 2
PIECE_ELEMS = 4 << 20  # elements per stored piece at most (16 MiB of FP32): bounds a resume's reads


def is_sharded(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a SlideDP distributed checkpoint directory (of any format: loading checks which)."""
    path = Path(path)
    return path.is_dir() and ((path / META).is_file() or (path / LEGACY_META).is_file())


def share(sizes: dict[str, int], world_size: int) -> list[list[str]]:
    """Parameters per rank, largest first to the least loaded rank (deterministic, balanced by elements)."""
    load = [0] * world_size
    out: list[list[str]] = [[] for _ in range(world_size)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world_size), key=lambda i: (load[i], i))
        out[r].append(name)
        load[r] += sizes[name]
    return out


def piece_key(key: str, start: int, stop: int) -> str:
    """The DCP key of the elements ``[start, stop)`` of the flattened tensor ``key`` (``model/<name>``)."""
    return f"{key}@{start}-{stop}"


def parse_piece(fqn: str) -> tuple[str, int, int] | None:
    """``(key, start, stop)`` of a :func:`piece_key`; None for any other key."""
    key, at, span = fqn.rpartition("@")
    start, dash, stop = span.partition("-")
    if not (at and dash and start.isdigit() and stop.isdigit()) or int(stop) < int(start):
        return None
    return key, int(start), int(stop)


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """Lightning's part of the checkpoint at ``path`` with the SlideDP header under ``"slidedp"``; refuses a
    checkpoint of another format (naming both)."""
    path = Path(path)
    if not (path / META).is_file():
        if (path / LEGACY_META).is_file():
            raise ValueError(
                f"{path} is a SlideDP checkpoint of format 1 (metadata pickled in {LEGACY_META}); this version of "
                f"slidedp-lightning reads format {FORMAT} only, whose metadata cannot run code when loaded. Export "
                "its weights with the release that wrote it (python -m slidedp_lightning.export) and start from them."
            )
        raise FileNotFoundError(f"{path} is not a SlideDP distributed checkpoint directory (no {META}).")
    try:
        doc = json.loads((path / META).read_text(encoding="utf-8"))
    except ValueError as err:  # not UTF-8, or not JSON
        raise ValueError(
            f"{path / META} is not JSON: a damaged checkpoint, or not one SlideDP wrote ({err})."
        ) from None
    found = (
        doc.get("slidedp", {}).get("format") if isinstance(doc, dict) and isinstance(doc.get("slidedp"), dict) else None
    )
    if found != FORMAT:
        raise ValueError(
            f"{path} is a SlideDP checkpoint of format {found!r}; this version of slidedp-lightning reads format "
            f"{FORMAT} only."
        )
    try:
        tensors = load_safetensors((path / TENSORS).read_bytes()) if (path / TENSORS).is_file() else {}
    except Exception as err:  # safetensors' own error type
        raise ValueError(f"{path / TENSORS} is not a safetensors file: a damaged checkpoint ({err}).") from None
    return decode(doc, tensors)


# -- the ledger's pieces ----------------------------------------------------------------------------------


def _job_size(engine) -> int:
    return engine.topology.world_size


def _mine(engine) -> list[str]:
    """The parameters this rank reads and writes: a balanced share of its host's (every host shares alike)."""
    sizes = {n: engine.layout.units[u].slots[s].numel for n, (u, s) in engine.state.named_slots().items()}
    index, count = engine.topology.checkpoint_share
    return share(sizes, count)[index]


def _held(engine, writing: bool = False) -> list[tuple[str, int, int, torch.Tensor]]:
    """``(key, start, stop, view)``: what this rank writes and reads, its share's parameters and moments, each
    the elements ``[start, stop)`` its host holds (all of them unless host-sharded) as a 1-D view of the
    ledger (wholly frozen units: no moments; their weights from the BF16 copy when they keep no master, written
    back by ``engine.restored`` when ``writing``)."""
    slots = engine.state.named_slots()
    out = []
    for key, view in engine.state.ledger_tensors(_mine(engine), writing).items():
        parts = engine.state.host_parts(slots[key.split("/", 1)[1]])
        lo, hi = parts[engine.topology.host] if engine.topology.host_sharded else parts[0]
        if hi > lo:
            out.append((key, lo, hi, view.view(-1)[lo:hi]))
    index, count = engine.topology.checkpoint_share
    for unit in engine.layout.units[index::count]:  # int8 moments: their per-block scales, one rank per unit
        for key, (lo, hi, view) in engine.state.scale_tensors(unit.index).items():
            if hi > lo:
                out.append((key, lo, hi, view))
    return out


def _pieces(held: list[tuple[str, int, int, torch.Tensor]]) -> list[tuple[str, int, int, torch.Tensor]]:
    """``held`` cut into pieces of at most :data:`PIECE_ELEMS` elements: a rank that loads reads each stored
    piece it needs into memory whole (DCP reads a chunk at a time), so the piece size bounds what a resume holds
    beside the ledger, however large a parameter is."""
    out = []
    for key, lo, hi, view in held:
        for a in range(lo, hi, PIECE_ELEMS):
            b = min(a + PIECE_ELEMS, hi)
            out.append((key, a, b, view[a - lo : b - lo]))
    return out


def ledger_mode(engine) -> dict[str, Any]:
    """What the ledger holds, recorded in ``meta.json``: the moments' form and whether a BF16 copy is kept."""
    return {"optimizer_state": engine.config.optimizer_state, "bf16_copy": engine.config.bf16_copy}


def check_mode(path: Path, info: dict[str, Any], engine) -> None:
    """Refuse a checkpoint whose moments are in another form than this run's ledger (older ones: fp32)."""
    saved, mine = info.get("optimizer_state", "fp32"), engine.config.optimizer_state
    if saved != mine:
        raise ValueError(
            f"checkpoint {path} holds optimizer_state={saved!r} Adam moments, and this run's ledger keeps "
            f"optimizer_state={mine!r} ones: resume with SlideDPStrategy(optimizer_state={saved!r}) (the "
            "bf16_copy option may differ)."
        )


def _stored(path: Path, metadata: Any) -> dict[str, list[tuple[int, int, str, TensorStorageMetadata]]]:
    """The pieces in a checkpoint's DCP metadata by tensor key, in element order (they must not overlap)."""
    out: dict[str, list[tuple[int, int, str, TensorStorageMetadata]]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        piece = parse_piece(fqn)
        if piece is None:
            continue
        key, start, stop = piece
        if (
            not isinstance(md, TensorStorageMetadata)
            or tuple(md.size) != (stop - start,)
            or any(len(c.offsets) != 1 or c.offsets[0] + c.sizes[0] > stop - start for c in md.chunks)
        ):
            raise ValueError(f"{path}: {fqn} is not a 1-D tensor of {stop - start} elements: a damaged checkpoint?")
        out.setdefault(key, []).append((start, stop, fqn, md))
    for pieces in out.values():
        pieces.sort(key=lambda p: p[:2])
        for (_, stop, a, _), (start, _, b, _) in zip(pieces, pieces[1:]):
            if start < stop:
                raise ValueError(f"{path}: the pieces {a} and {b} overlap: a damaged checkpoint?")
    return out


class _RangeReads(LoadPlanner):
    """A DCP load planner that reads exactly the given items: element ranges of stored 1-D pieces into element
    ranges of the 1-D tensors of the state dict. Tensors only: the checkpoint's objects are never unpickled."""

    def __init__(self, items: list[ReadItem]) -> None:
        self.items = items
        self.state_dict: dict[str, torch.Tensor] = {}

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        self.state_dict = state_dict

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan(self.items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise ValueError(f"a SlideDP checkpoint holds tensors only; {read_item.storage_index.fqn} is an object")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.state_dict[read_item.dest_index.fqn].narrow(0, read_item.dest_offsets[0], read_item.lengths[0])

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def read_ranges(
    path: str | os.PathLike,
    wanted: Iterable[tuple[str, int, int, torch.Tensor]],
    process_group: Any = None,
    no_dist: bool = False,
) -> None:
    """Fill each ``(key, start, stop, out)`` of ``wanted`` (``out`` 1-D, ``stop - start`` elements) with the
    elements ``[start, stop)`` of the flattened tensor ``key`` of the checkpoint at ``path``, from the pieces
    that overlap them: one DCP load (collective over ``process_group`` unless ``no_dist``). Each stored piece
    is read into memory whole, once per range it overlaps, as DCP reads any chunk."""
    path = Path(path)
    reader = CheckedFileSystemReader(path)
    stored = _stored(path, reader.read_metadata())
    items, dest = [], {}
    for key, lo, hi, out in wanted:
        name = piece_key(key, lo, hi)
        dest[name] = out
        covered = 0
        for start, _, fqn, md in stored.get(key, ()):
            for i, chunk in enumerate(md.chunks):  # one chunk per piece as written; any 1-D chunking reads alike
                c0 = start + chunk.offsets[0]
                a, b = max(lo, c0), min(hi, c0 + chunk.sizes[0])
                if a < b:
                    items.append(
                        ReadItem(
                            type=LoadItemType.TENSOR,
                            dest_index=MetadataIndex(name),
                            dest_offsets=torch.Size([a - lo]),
                            storage_index=MetadataIndex(fqn, chunk.offsets, i),
                            storage_offsets=torch.Size([a - c0]),
                            lengths=torch.Size([b - a]),
                        )
                    )
                    covered += b - a
        if covered != hi - lo:
            raise ValueError(
                f"{path} holds {covered} of the elements [{lo}, {hi}) of {key}: an incomplete or damaged checkpoint."
            )
    dcp.load(dest, storage_reader=reader, planner=_RangeReads(items), process_group=process_group, no_dist=no_dist)


# -- save and load ------------------------------------------------------------------------------------------


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


def _meta_files(engine, checkpoint: dict[str, Any]) -> tuple[bytes, bytes]:
    """``meta.json`` and ``meta.safetensors`` of a checkpoint: Lightning's dict without the state dict, and the
    SlideDP header."""
    meta = {k: v for k, v in checkpoint.items() if k != "state_dict"}
    slots = engine.state.named_slots()
    meta["slidedp"] = {
        "format": FORMAT,
        "step": engine.step,
        "world_size": _job_size(engine),
        "params": {n: list(engine.layout.units[u].slots[s].shape) for n, (u, s) in sorted(slots.items())},
        "buffers": engine.state.buffers(),
        **ledger_mode(engine),
        **_hf_configs(engine.model),
    }
    tensors: dict[str, torch.Tensor] = {}
    doc = encode(meta, tensors)
    return json.dumps(doc, indent=1).encode(), save_safetensors(tensors)


def save(engine, checkpoint: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``checkpoint`` (Lightning's dict, without the tensors the ledger holds) and the ledger to ``path``
    (a symbolic link's target)."""
    path = Path(_agree(engine, str(write_target(Path(path)))))
    tmp = Path(_agree(engine, str(_hidden(path, "tmp"))))
    if engine.topology.global_rank == 0:
        remove_stale_saves(path)
    engine.synchronize()
    files, failed = None, None
    if engine.topology.global_rank == 0:  # before any rank writes: what cannot be stored stops every rank
        try:
            files = _meta_files(engine, checkpoint)
        except Exception as err:
            failed = err
    reason = _agree(engine, None if failed is None else (type(failed) is CheckpointContentError, str(failed)))
    if reason is not None:
        kind = CheckpointContentError if reason[0] else RuntimeError
        raise kind(f"SlideDP checkpoint {path} not written: {reason[1]}") from failed
    try:
        dcp.save(
            {piece_key(k, a, b): v for k, a, b, v in _pieces(_held(engine))},
            checkpoint_id=tmp,
            process_group=_job_group(engine),
        )
        if files is not None:
            (tmp / META).write_bytes(files[0])
            (tmp / TENSORS).write_bytes(files[1])
        _barrier(engine)
    except BaseException:  # a failed or signalled save: its hidden directory goes (a SIGKILLed one: at the next save)
        if engine.topology.global_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if engine.topology.global_rank == 0:
        _swap_in(tmp, path)
        log.info("SlideDP checkpoint (step %d, %d ranks) written to %s", engine.step, _job_size(engine), path)
    _barrier(engine)


def _hf_configs(model) -> dict[str, dict]:
    """A transformers model's config and generation config, so that the checkpoint exports on its own."""
    out = {}
    for key, attr in (("hf_config", "config"), ("generation_config", "generation_config")):
        value = getattr(model, attr, None)
        if value is not None and hasattr(value, "to_dict"):
            out[key] = value.to_dict()
    return out


def write_target(path: Path) -> Path:
    """Where a save to ``path`` goes: ``path``, or the final target of the symbolic link it is."""
    if not path.is_symlink():
        return path
    target = Path(os.path.realpath(path))
    log.info("SlideDP checkpoint path %s is a symbolic link: writing the checkpoint at its target %s", path, target)
    return target


def _hidden(path: Path, kind: str) -> Path:
    """A hidden sibling of ``path`` (``kind``: "tmp" for a save being written, "old" for the checkpoint it
    replaces), named after this process so that :func:`remove_stale_saves` can tell whether its writer lives."""
    pid = os.getpid()
    return path.with_name(f".{path.name}.{kind}-{_host()}-{pid}-{process_start_time(pid)}-{uuid.uuid4().hex[:8]}")


def _host() -> str:
    return "".join(c if c.isalnum() or c in "._" else "_" for c in socket.gethostname()) or "host"


def remove_stale_saves(path: Path) -> list[Path]:
    """Remove the hidden directories that saves to ``path`` killed midway left behind: those whose writing process
    (on this host) is gone. A live process's, another host's and an unnamed one are kept; so is a replaced checkpoint
    (``.old-``) while ``path`` itself is missing (a save killed between its two renames: the only whole copy)."""
    removed: list[Path] = []
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return removed
    host = _host()
    for entry in entries:
        kind = next((k for k in ("tmp", "old") if entry.name.startswith(f".{path.name}.{k}-")), None)
        if kind is None:
            continue
        parts = entry.name[len(f".{path.name}.{kind}-") :].rsplit("-", 3)
        if len(parts) != 4 or parts[0] != host or not parts[1].isdigit() or parts[2] == "None":
            log.debug("SlideDP: keeping %s (its writer cannot be checked from this process)", entry)
            continue
        if process_start_time(int(parts[1])) == parts[2]:
            continue  # a save that is still running
        if kind == "old" and not path.exists():
            log.warning("SlideDP: %s is the previous checkpoint of %s, which is missing: keeping it", entry, path)
            continue
        size = _tree_bytes(entry)
        try:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        except OSError as err:
            log.warning("SlideDP: could not remove %s, left by an interrupted save: %s", entry, err)
            continue
        removed.append(entry)
        log.warning(
            "SlideDP removed %s (%s), left by a save to %s whose process (pid %s) is gone",
            entry.name,
            format_bytes(size),
            path,
            parts[1],
        )
    return removed


def _tree_bytes(path: Path) -> int:
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size
    return sum(f.lstat().st_size for f in path.rglob("*") if not f.is_dir())


def _swap_in(tmp: Path, path: Path) -> None:
    """Put the finished ``tmp`` at ``path``; the previous checkpoint there goes only once it is replaced."""
    old = None
    if path.exists() or path.is_symlink():
        old = _hidden(path, "old")
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()


def load(engine, path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save` (with any number of ranks and hosts, either host layout) into
    the ledger; returns Lightning's part of it."""
    path = Path(_agree(engine, str(path)))
    meta = read_meta(path)
    info = meta["slidedp"]
    slots = engine.state.named_slots()
    shapes = {n: list(engine.layout.units[u].slots[s].shape) for n, (u, s) in slots.items()}
    if info["params"] != shapes:
        missing, unexpected = sorted(set(shapes) - set(info["params"])), sorted(set(info["params"]) - set(shapes))
        reshaped = sorted(n for n in set(shapes) & set(info["params"]) if shapes[n] != info["params"][n])
        raise KeyError(
            f"checkpoint {path} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}, "
            f"other shapes {reshaped[:5]}"
        )
    check_mode(path, info, engine)
    engine.synchronize()
    engine.drop_resident()
    read_ranges(path, _held(engine, writing=True), process_group=_job_group(engine))
    engine.restored(info["step"], info["buffers"])
    log.info(
        "SlideDP checkpoint %s (step %d, saved by %d ranks) loaded on %d ranks",
        path,
        info["step"],
        info["world_size"],
        _job_size(engine),
    )
    return meta
