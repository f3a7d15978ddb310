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

``meta.json`` carries each other file's size and XXH3-64 (every rank checksums the files it wrote, rank 0 records
them); a resume checks them (each rank a share of the files, the large ones while DCP reads them), so a truncated
or corrupted file is refused by name instead of loaded.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import shutil
import socket
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch.distributed.checkpoint import LoadPlan, LoadPlanner, ReadItem, TensorStorageMetadata
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType

from cpu_ops.adamw8 import MOMENT_FORMAT
from slidedp_lightning.checkpoint_json import CheckpointContentError, decode, encode
from slidedp_lightning.runtime.compat import CheckedFileSystemReader, UnsafeCheckpointError
from slidedp_lightning.runtime.host_os import format_bytes, process_start_time

log = logging.getLogger(__name__)

META = "meta.json"
TENSORS = "meta.safetensors"
LEGACY_META = "meta.pt"  # format 1: the metadata pickled
FORMAT = 2
PIECE_ELEMS = 4 << 20  # elements per stored piece at most (16 MiB of FP32): bounds a resume's reads
DCP_METADATA = ".metadata"
_WINDOW = 64 << 20  # bytes of a file mapped and hashed at a time (a multiple of mmap.ALLOCATIONGRANULARITY)
CHECKSUMS = "files"  # meta.json's "slidedp" entry: {file name: [size, XXH3-64]} of every other file


def is_sharded(path: str | os.PathLike) -> bool:
    """Whether ``path`` is to be read as a SlideDP distributed checkpoint: any directory (the full format is a
    file), so that loading one says what it lacks (format, ``meta.json``) instead of failing to open a directory."""
    return Path(path).is_dir()


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
        if (path / DCP_METADATA).is_file() or any(path.glob("*.distcp")):
            raise FileNotFoundError(
                f"{path} holds DCP files but no {META}: an incomplete checkpoint (a save that did not finish, or a "
                "file deleted since); resume from another checkpoint."
            )
        raise FileNotFoundError(
            f"{path} is not a SlideDP distributed checkpoint (no {META}): pass the directory a SlideDP save wrote."
        )
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


def own_storage(view: torch.Tensor) -> torch.Tensor:
    """``view`` (a contiguous slice of the ledger) as a tensor whose storage is exactly its bytes, aliasing the same
    memory. DCP's writer clones a tensor whose storage is larger than it and keeps every tensor of a file until the
    file is written (torch 2.13, for its safetensors option): given slices of the ledger, each rank would copy its
    whole share of the checkpoint into memory at every save."""
    if view.untyped_storage().nbytes() == view.nbytes:
        return view
    as_bytes = view.reshape(-1).view(torch.uint8).numpy()  # the same memory, as numpy sees it
    return torch.from_numpy(as_bytes).view(view.dtype).view(view.shape)  # a storage of exactly these bytes


def ledger_mode(engine) -> dict[str, Any]:
    """What the ledger holds, recorded in ``meta.json``: the moments' form (with int8 moments, the code that wrote
    them, :data:`cpu_ops.adamw8.MOMENT_FORMAT`) and whether a BF16 copy is kept."""
    mode = {"optimizer_state": engine.config.optimizer_state, "bf16_copy": engine.config.bf16_copy}
    if engine.config.optimizer_state == "int8":
        mode["moment_format"] = MOMENT_FORMAT
    return mode


def check_mode(path: Path, info: dict[str, Any], engine) -> None:
    """Refuse a checkpoint whose moments are in another form than this run's ledger (older ones: fp32), or int8
    moments of another code than this release reads (older ones: the dynamic tree, which it no longer decodes)."""
    saved, mine = info.get("optimizer_state", "fp32"), engine.config.optimizer_state
    if saved != mine:
        raise ValueError(
            f"checkpoint {path} holds optimizer_state={saved!r} Adam moments, and this run's ledger keeps "
            f"optimizer_state={mine!r} ones: resume with SlideDPStrategy(optimizer_state={saved!r}) (the "
            "bf16_copy option may differ)."
        )
    code = info.get("moment_format", "dynamic-tree")
    if mine == "int8" and code != MOMENT_FORMAT:
        raise ValueError(
            f"checkpoint {path} holds int8 Adam moments in the {code!r} code, and this release reads "
            f"{MOMENT_FORMAT!r} codes: resume it with the release that wrote it, or start the moments afresh "
            "(load its weights alone: slidedp_lightning.export it, then from_pretrained)."
        )


def _dcp_metadata(path: Path, reader: CheckedFileSystemReader) -> Any:
    """DCP's metadata of the checkpoint at ``path``; an unreadable one is refused naming the file."""
    try:
        return reader.read_metadata()
    except (UnsafeCheckpointError, PermissionError):
        raise
    except Exception as err:  # truncated or garbled pickle, missing file: name the file, not the unpickler
        raise CorruptCheckpointError(
            f"checkpoint {path} is damaged: {path / DCP_METADATA} cannot be read ({type(err).__name__}: {err}); "
            "resume from another checkpoint."
        ) from None


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
    stored = _stored(path, _dcp_metadata(path, reader))
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


# -- integrity ----------------------------------------------------------------------------------------------


class CorruptCheckpointError(ValueError):
    """A file of a checkpoint is missing, truncated, corrupted or unreadable (the message names it)."""


def file_checksum(path: str | os.PathLike) -> int:
    """XXH3-64 of the file at ``path``, hashed from memory maps of one window of it at a time: no copy (about ten
    times the speed of a CRC-32 over read buffers, docs/PERFORMANCE.md), and never more than a window of a large
    checkpoint mapped into this process."""
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        for offset in range(0, size, _WINDOW):
            with mmap.mmap(f.fileno(), min(_WINDOW, size - offset), offset=offset, access=mmap.ACCESS_READ) as m:
                digest.update(m)
    return digest.intdigest()


def _sums(files: Iterable[Path]) -> dict[str, list[int]]:
    return {f.name: [f.stat().st_size, file_checksum(f)] for f in files}


def verify_files(path: Path, expected: dict[str, list[int]], names: Iterable[str]) -> str | None:
    """The first of the files ``names`` of the checkpoint at ``path`` whose size or XXH3-64 is not the recorded one,
    as one line saying what is wrong; None when all match."""
    for name in names:
        size, crc = expected[name]
        f = path / name
        try:
            if not f.is_file():
                return f"{f} is missing"
            found = f.stat().st_size
            if found != size:
                return f"{f} holds {found} bytes and its save wrote {size} (a truncated or overwritten file)"
            if file_checksum(f) != crc:
                return f"{f} does not match the XXH3-64 its save recorded (the file is corrupted)"
        except OSError as err:
            return f"{f} cannot be read ({err.strerror or err})"
    return None


def _damaged(path: Path, problem: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"checkpoint {path} is damaged: {problem}; resume from another checkpoint.")


def check_files(path: Path, expected: dict[str, list[int]], names: list[str]) -> None:
    """Refuse the checkpoint at ``path`` if DCP's metadata is planted (refused as such) or unreadable, or one of the
    files ``names`` is not as its save recorded (:func:`verify_files`)."""
    try:
        _dcp_metadata(path, CheckedFileSystemReader(path))
    except CorruptCheckpointError:
        problem = verify_files(path, expected, names)
        if problem is not None:
            raise _damaged(path, problem) from None
        raise
    problem = verify_files(path, expected, names)
    if problem is not None:
        raise _damaged(path, problem)


class _Verifier:
    """Checks this rank's share of a checkpoint's large files on a thread of its own (the hash and the reads
    release the GIL), while DCP reads the checkpoint; :meth:`result` joins it."""

    def __init__(self, path: Path, expected: dict[str, list[int]], names: list[str]) -> None:
        self.problem: str | None = None
        self._thread = threading.Thread(target=self._run, args=(path, expected, names), daemon=True)
        self._thread.start()

    def _run(self, path: Path, expected: dict[str, list[int]], names: list[str]) -> None:
        self.problem = verify_files(path, expected, names)

    def result(self) -> str | None:
        self._thread.join()
        return self.problem


def _gather(engine, value: Any) -> list[Any]:
    if _job_size(engine) == 1:
        return [value]
    out: list[Any] = [None] * _job_size(engine)
    dist.all_gather_object(out, value, group=_job_group(engine))
    return out


def _no_space(err: BaseException, where: Path) -> bool:
    """Whether a failed write ran out of disk space (torch's zip writer says only "file write failed"; DCP gives
    each rank's error in ``failures``)."""
    failures = [f[0] if isinstance(f, tuple) else f for f in getattr(err, "failures", {}).values()]
    inner = [*failures, err.__cause__, err.__context__]
    if any(isinstance(e, BaseException) and e is not err and _no_space(e, where) for e in inner):
        return True
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(err)
    if any(m in text for m in ("No space left", "Disk quota exceeded", "[Errno 28]", "[Errno 122]")):
        return True
    if "file write failed" in text or "inline_container" in text:
        try:
            return shutil.disk_usage(where).free < (64 << 20)
        except OSError:
            return False
    return False


def _space_error(err: BaseException, path: Path, what: str, nbytes: int) -> OSError:
    try:
        free = format_bytes(shutil.disk_usage(path.parent).free)
    except OSError:
        free = "unknown"
    return OSError(
        errno.ENOSPC,
        f"{what} {path} not written: no space left on the device of {path.parent} ({free} free, it takes about "
        f"{format_bytes(nbytes)}); free space there or write to another directory (the previous one is kept)",
    )


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


def _meta_files(engine, checkpoint: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """``meta.json`` (as JSON data, its checksums to be added) and ``meta.safetensors`` of a checkpoint:
    Lightning's dict without the state dict, and the SlideDP header."""
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
    return doc, save_safetensors(tensors)


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
    rank = engine.topology.global_rank
    try:
        try:
            dcp.save(
                {piece_key(k, a, b): own_storage(v) for k, a, b, v in _pieces(_held(engine))},
                checkpoint_id=tmp,
                process_group=_job_group(engine),
            )
            written = _gather(engine, _sums(sorted(tmp.glob(f"__{rank}_*"))))  # the files this rank wrote
            if files is not None:
                doc, tensors = files
                (tmp / TENSORS).write_bytes(tensors)
                sums = {k: v for part in written for k, v in part.items()}
                sums.update(_sums([tmp / DCP_METADATA, tmp / TENSORS]))
                doc["slidedp"][CHECKSUMS] = dict(sorted(sums.items()))
                (tmp / META).write_text(json.dumps(doc, indent=1), encoding="utf-8")
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            if not isinstance(err, (KeyboardInterrupt, SystemExit)) and _no_space(err, tmp.parent):
                raise _space_error(err, path, "SlideDP checkpoint", _checkpoint_bytes(engine)) from None
            raise
        _barrier(engine)
    except BaseException:  # a failed or signalled save: its hidden directory goes (a SIGKILLed one: at the next save)
        if engine.topology.global_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if engine.topology.global_rank == 0:
        _swap_in(tmp, path)
        log.info("SlideDP checkpoint (step %d, %d ranks) written to %s", engine.step, _job_size(engine), path)
    _barrier(engine)


def _checkpoint_bytes(engine) -> int:
    """About what a checkpoint of ``engine`` takes on disk: every ledger tensor it stores."""
    views = engine.state.ledger_tensors(list(engine.state.named_slots()))
    return sum(v.numel() * v.element_size() for v in views.values())


def _hf_configs(model) -> dict[str, dict]:
    """A transformers model's config and generation config (and a peft model's adapter configs), so that the
    checkpoint exports on its own."""
    from slidedp_lightning.export import peft_configs

    out = {}
    for key, attr in (("hf_config", "config"), ("generation_config", "generation_config")):
        value = getattr(model, attr, None)
        if value is not None and hasattr(value, "to_dict"):
            out[key] = value.to_dict()
    return {**out, **peft_configs(model)}


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


def _check_moments(path: Path, engine) -> None:
    """Refuse a checkpoint that holds no Adam moments for parameters this run trains (they were frozen when it was
    saved); moments of parameters this run freezes are left unread."""
    stored = _stored(path, _dcp_metadata(path, CheckedFileSystemReader(path)))
    saved = {k.split("/", 1)[1] for k in stored if k.startswith("exp_avg/")}
    views = engine.state.ledger_tensors(list(engine.state.named_slots()))
    mine = {k.split("/", 1)[1] for k in views if k.startswith("exp_avg/")}
    if mine - saved:
        names = sorted(mine - saved)
        raise ValueError(
            f"checkpoint {path} was saved with {len(names)} parameter(s) frozen that this run trains (e.g. "
            f"{names[:3]}), so it holds no Adam moments for them: freeze the same parameters as the run that saved "
            "it, or start a new run from its weights (python -m slidedp_lightning.export CKPT OUT, then "
            "from_pretrained(OUT))."
        )
    if saved - mine:
        log.warning(
            "SlideDP checkpoint %s holds Adam moments of %d parameter(s) this run freezes (e.g. %s): not read",
            path,
            len(saved - mine),
            sorted(saved - mine)[:3],
        )


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
    expected: dict[str, list[int]] = info.get(CHECKSUMS) or {}
    if not expected:
        log.info("SlideDP checkpoint %s records no checksums (written by an older release): not verified", path)
    small = sorted(n for n in expected if not n.endswith(".distcp"))
    check_files(path, expected, small)  # every rank: a few small files, read by every rank anyway
    _check_moments(path, engine)
    large = sorted(n for n in expected if n.endswith(".distcp"))
    index, count = engine.topology.global_rank, _job_size(engine)
    verifier = _Verifier(path, expected, share({n: expected[n][0] for n in large}, count)[index])
    engine.synchronize()
    engine.drop_resident()
    try:
        read_ranges(path, _held(engine, writing=True), process_group=_job_group(engine))
    except BaseException as err:  # a damaged file DCP tripped over: name it
        problem = verifier.result()
        if problem is not None:
            raise _damaged(path, problem) from err
        raise
    problems = [p for p in _gather(engine, verifier.result()) if p is not None]
    if problems:
        raise _damaged(path, problems[0])
    engine.restored(info["step"], info["buffers"])
    log.info(
        "SlideDP checkpoint %s (step %d, saved by %d ranks) loaded on %d ranks",
        path,
        info["step"],
        info["world_size"],
        _job_size(engine),
    )
    return meta
