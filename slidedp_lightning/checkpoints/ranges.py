"""Reading a distributed checkpoint by element ranges: each stored piece (a parameter's elements [a, b), key
``name@a-b``) that overlaps what a rank holds is read into it, so a checkpoint loads on any number of ranks and
hosts, and offline (export), one range at a time."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, LoadPlan, LoadPlanner, ReadItem, TensorStorageMetadata
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType

from slidedp_lightning.checkpoints.files import CorruptCheckpointError, tensor_digest
from slidedp_lightning.runtime.compat import DCP_METADATA, CheckedFileSystemReader, UnsafeCheckpointError


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


def dcp_metadata(path: Path, reader: CheckedFileSystemReader) -> Any:
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


def stored_pieces(path: Path, metadata: Any) -> dict[str, list[tuple[int, int, str, TensorStorageMetadata]]]:
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


@dataclass
class PieceChecks:
    """What :func:`read_ranges` read and could vouch for: the stored files it read from, the files among them
    holding a piece it read in part or without a recorded digest (their bytes unchecked), and one line per piece
    whose bytes did not match its digest."""

    files_read: set[str] = field(default_factory=set)
    unchecked_files: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)


class _RangeReads(LoadPlanner):
    """A DCP load planner that reads exactly the given items: element ranges of stored 1-D pieces into element
    ranges of the 1-D tensors of the state dict. Tensors only: the checkpoint's objects are never unpickled. A
    piece read whole whose digest is known is hashed right after DCP copied it (in cache) and compared."""

    def __init__(
        self, items: list[ReadItem], digests: dict[str, int], files: dict[str, str], path: Path, checks: PieceChecks
    ) -> None:
        self.items, self.digests, self.files, self.path, self.checks = items, digests, files, path, checks
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
        fqn = read_item.storage_index.fqn
        want = self.digests.get(fqn)
        piece = parse_piece(fqn)
        whole = piece is not None and read_item.storage_offsets[0] == 0 and tensor.numel() == piece[2] - piece[1]
        if want is None or not whole:
            self.checks.unchecked_files.add(self.files[fqn])
        elif tensor_digest(tensor) != want:
            self.checks.problems.append(
                f"{self.path / self.files[fqn]} does not match the XXH3-64 its save recorded for {fqn} "
                "(the file is corrupted)"
            )


def read_ranges(
    path: str | os.PathLike,
    wanted: Iterable[tuple[str, int, int, torch.Tensor]],
    process_group: Any = None,
    no_dist: bool = False,
    *,
    digests: dict[str, int] | None = None,
    checks: PieceChecks | None = None,
    reader: CheckedFileSystemReader | None = None,
) -> None:
    """Fill each ``(key, start, stop, out)`` of ``wanted`` (``out`` 1-D, ``stop - start`` elements) with the
    elements ``[start, stop)`` of the flattened tensor ``key`` of the checkpoint at ``path``, from the pieces
    that overlap them: one DCP load (collective over ``process_group`` unless ``no_dist``). Each stored piece
    is read into memory whole, once per range it overlaps, as DCP reads any chunk. ``digests`` (the save's
    XXH3-64 per piece): each piece read whole is checked; what was found goes into ``checks`` (filled before
    DCP reads, so a caller sees which files were read even when the read raises). ``reader``: the caller's reader
    of ``path`` (its metadata read once)."""
    path = Path(path)
    checks = checks if checks is not None else PieceChecks()
    reader = reader or CheckedFileSystemReader(path)
    metadata = dcp_metadata(path, reader)
    stored = stored_pieces(path, metadata)
    files = {index.fqn: info.relative_path for index, info in metadata.storage_data.items()}
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
    checks.files_read.update(files[item.storage_index.fqn] for item in items)
    planner = _RangeReads(items, digests or {}, files, path, checks)
    try:
        dcp.load(dest, storage_reader=reader, planner=planner, process_group=process_group, no_dist=no_dist)
    except CheckpointException as err:  # DCP wraps even a KeyboardInterrupt: a signal on this rank stays itself
        rank = 0 if no_dist or not dist.is_initialized() else dist.get_rank(process_group)
        own = err.failures.get(rank)
        if own is not None and not isinstance(own[0], Exception):
            raise own[0] from None
        raise
