"""Sharded checkpoints of the host ledger through ``torch.distributed.checkpoint``, written atomically.

A checkpoint (format 3) is a directory:

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
them), and the XXH3-64 of its own content; a resume checks them (each rank a share of the files, the large ones
while DCP reads them), so a truncated, corrupted or edited file is refused by name instead of loaded. Format 2
(the same without the hash of ``meta.json``, written by earlier releases) still loads, its ``meta.json`` unverified
(logged); a format-3 ``meta.json`` that lost its hash is refused, so damage cannot pass it off as format 2.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch.distributed.checkpoint import CheckpointException

from cpu_ops.adamw8 import MOMENT_FORMAT
from slidedp_lightning.checkpoints.files import (
    CHECKSUMS,
    META_HASH,
    PIECES,
    CorruptCheckpointError,
    Verifier,
    content_digest,
    damaged,
    hidden_sibling,
    no_space,
    remove_stale_saves,
    space_error,
    sums,
    swap_in,
    tensor_digest,
    verify_files,
    write_target,
)
from slidedp_lightning.checkpoints.json_codec import CheckpointContentError, decode, encode
from slidedp_lightning.checkpoints.ranges import PieceChecks, dcp_metadata, piece_key, read_ranges, stored_pieces
from slidedp_lightning.hf.peft import peft_configs
from slidedp_lightning.runtime.compat import DCP_METADATA, CheckedFileSystemReader

if TYPE_CHECKING:
    from slidedp_lightning.checkpoints.engine_view import EngineView

log = logging.getLogger(__name__)

META = "meta.json"
TENSORS = "meta.safetensors"
LEGACY_META = "meta.pt"  # format 1: the metadata pickled
FORMAT = 3  # meta.json carries the XXH3-64 of its own content
READABLE = (2, FORMAT)  # format 2: the same, meta.json without its own hash
PIECE_ELEMS = 4 << 20  # elements per stored piece at most (16 MiB of FP32): bounds a resume's reads


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


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """Lightning's part of the checkpoint at ``path`` with the SlideDP header under ``"slidedp"``; refuses a
    checkpoint of another format (naming both)."""
    path = Path(path)
    if not (path / META).is_file():
        if (path / LEGACY_META).is_file():
            raise ValueError(
                f"{path} is a SlideDP checkpoint of format 1 (metadata pickled in {LEGACY_META}); this version of "
                f"slidedp-lightning reads formats {_formats()} only, whose metadata cannot run code when loaded. Export "
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
    doc = _checked_meta(path)
    try:
        tensors = load_safetensors((path / TENSORS).read_bytes()) if (path / TENSORS).is_file() else {}
    except Exception as err:  # safetensors' own error type
        raise ValueError(f"{path / TENSORS} is not a safetensors file: a damaged checkpoint ({err}).") from None
    return decode(doc, tensors)


def _formats() -> str:
    return " and ".join(map(str, READABLE))


def _checked_meta(path: Path) -> dict[str, Any]:
    """``meta.json`` of the checkpoint at ``path`` parsed, of a format this release reads, and (format 3, or any
    that records one) matching the hash of its content that its save recorded in it. A single changed byte is
    refused naming the file whatever it hits (a key, the format, the hash): never read as another format's file."""
    try:
        doc = json.loads((path / META).read_text(encoding="utf-8"))
    except ValueError as err:  # not UTF-8, or not JSON: truncated, or a byte changed
        raise damaged(path, f"{path / META} is not JSON ({err})") from None
    header = doc.get("slidedp") if isinstance(doc, dict) else None
    if not isinstance(header, dict):
        raise damaged(path, f"{path / META} holds no SlideDP header (a 'slidedp' entry)")
    found, recorded = header.get("format"), header.get(META_HASH)
    if recorded is not None and recorded != content_digest(doc):
        raise damaged(
            path,
            f"{path / META} does not match the XXH3-64 of its content recorded in it (the file was edited or is "
            "corrupted)",
        )
    if found not in READABLE:
        raise ValueError(
            f"{path} is a SlideDP checkpoint of format {found!r}; this version of slidedp-lightning reads formats "
            f"{_formats()} only."
        )
    if recorded is None and found == FORMAT:
        raise damaged(
            path,
            f"{path / META} is of format {FORMAT} and lacks the {META_HASH!r} hash of its content that every save of "
            "that format records (the file was edited or is corrupted)",
        )
    if recorded is None:
        log.warning(
            "SlideDP checkpoint %s is of format %s (an earlier release): its %s carries no hash of itself and is "
            "not verified",
            path,
            found,
            META,
        )
    return doc


# -- the ledger's pieces ----------------------------------------------------------------------------------


def _job_size(engine: EngineView) -> int:
    return engine.topology.world_size


def _mine(engine: EngineView) -> list[str]:
    """The parameters this rank reads and writes: a balanced share of its host's (every host shares alike)."""
    sizes = {n: engine.layout.units[u].slots[s].numel for n, (u, s) in engine.state.named_slots().items()}
    index, count = engine.topology.checkpoint_share
    return share(sizes, count)[index]


def _held(engine: EngineView, writing: bool = False) -> list[tuple[str, int, int, torch.Tensor]]:
    """``(key, start, stop, view)``: what this rank writes and reads, its share's parameters and moments, each
    the elements ``[start, stop)`` its host holds (all of them unless host-sharded) as a 1-D view of the
    ledger (wholly frozen units: no moments; their weights from the BF16 copy when they keep no master, written
    back by ``engine.restored`` when ``writing``)."""
    slots = engine.state.named_slots()
    out = []
    mine = _mine(engine)
    for key, view in engine.state.ledger_tensors(mine, writing).items():
        parts = engine.state.host_parts(slots[key.split("/", 1)[1]])
        lo, hi = parts[engine.topology.host] if engine.topology.host_sharded else parts[0]
        if hi > lo:
            out.append((key, lo, hi, view.view(-1)[lo:hi]))
    out += engine.state.disk_state_views(mine)  # state in a file on disk: a piece per record
    index, count = engine.topology.checkpoint_share
    for unit in engine.layout.units[index::count]:  # int8 moments: their per-block scales, one rank per unit
        for key, (lo, hi, view) in engine.state.scale_tensors(unit.index).items():
            if hi > lo:
                out.append((key, lo, hi, view))
        out += engine.state.disk_scale_views(unit.index)
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


def ledger_mode(engine: EngineView) -> dict[str, Any]:
    """What the ledger holds, recorded in ``meta.json``: the moments' form (with int8 moments, the code that wrote
    them, :data:`cpu_ops.adamw8.MOMENT_FORMAT`) and whether a BF16 copy is kept."""
    mode = {"optimizer_state": engine.config.optimizer_state, "bf16_copy": engine.config.bf16_copy}
    if engine.config.optimizer_state == "int8":
        mode["moment_format"] = MOMENT_FORMAT
    return mode


def check_mode(path: Path, info: dict[str, Any], engine: EngineView) -> None:
    """Refuse a checkpoint whose moments are in another form than this run's ledger (older ones: fp32), or int8
    moments of another code than this release reads (older ones: the dynamic tree, or the linear ``int8-e4m3``; no
    release decodes them into this code, which would not be exact)."""
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


# -- integrity ----------------------------------------------------------------------------------------------


def check_files(
    path: Path, expected: dict[str, list[int]], names: list[str], reader: CheckedFileSystemReader | None = None
) -> None:
    """Refuse the checkpoint at ``path`` if DCP's metadata is planted (refused as such) or unreadable, or one of the
    files ``names`` is not as its save recorded (:func:`verify_files`). ``reader``: the caller's, which keeps the
    metadata it read."""
    try:
        dcp_metadata(path, reader or CheckedFileSystemReader(path))
    except CorruptCheckpointError:
        problem = verify_files(path, expected, names)
        if problem is not None:
            raise damaged(path, problem) from None
        raise
    problem = verify_files(path, expected, names)
    if problem is not None:
        raise damaged(path, problem)


def _gather(engine: EngineView, value: Any) -> list[Any]:
    if _job_size(engine) == 1:
        return [value]
    out: list[Any] = [None] * _job_size(engine)
    dist.all_gather_object(out, value, group=_job_group(engine))
    return out


# -- save and load ------------------------------------------------------------------------------------------


def _job_group(engine: EngineView):
    """Every rank of the job (several hosts: each host's ledger is complete, its ranks split the work)."""
    return engine.topology.job_group


def _barrier(engine: EngineView) -> None:
    if _job_size(engine) > 1:
        dist.barrier(group=_job_group(engine))


def _agree(engine: EngineView, value: Any) -> Any:
    if _job_size(engine) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=_job_group(engine))
    return box[0]


def _meta_files(engine: EngineView, checkpoint: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
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


def save(engine: EngineView, checkpoint: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``checkpoint`` (Lightning's dict, without the tensors the ledger holds) and the ledger to ``path``
    (a symbolic link's target)."""
    path = Path(_agree(engine, str(write_target(Path(path)))))
    tmp = Path(_agree(engine, str(hidden_sibling(path, "tmp"))))
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
            pieces = {piece_key(k, a, b): own_storage(v) for k, a, b, v in _pieces(_held(engine))}
            with engine.state.disk_paging():  # (moments on disk: their pages handed back as DCP and the digests go)
                dcp.save(pieces, checkpoint_id=tmp, process_group=_job_group(engine))
                digests = {k: tensor_digest(v) for k, v in pieces.items()}
            # the files this rank wrote, and its pieces' digests (what a resume checks as it reads them)
            mine = sums(sorted(tmp.glob(f"__{rank}_*"))), digests
            del pieces
            engine.state.release_disk_views()
            written = _gather(engine, mine)
            if files is not None:
                doc, tensors = files
                (tmp / TENSORS).write_bytes(tensors)
                hashes = {k: v for part, _ in written for k, v in part.items()}
                hashes.update(sums([tmp / DCP_METADATA, tmp / TENSORS]))
                doc["slidedp"][CHECKSUMS] = dict(sorted(hashes.items()))
                doc["slidedp"][PIECES] = dict(sorted((k, v) for _, part in written for k, v in part.items()))
                doc["slidedp"][META_HASH] = content_digest(json.loads(json.dumps(doc)))  # of what a resume parses
                (tmp / META).write_text(json.dumps(doc, indent=1), encoding="utf-8")
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            if not isinstance(err, (KeyboardInterrupt, SystemExit)) and no_space(err, tmp.parent):
                if rank == 0:  # the free space the error names: with the failed save's files gone
                    shutil.rmtree(tmp, ignore_errors=True)
                raise space_error(err, path, "SlideDP checkpoint", _checkpoint_bytes(engine)) from None
            raise
        _barrier(engine)
    except BaseException:  # a failed or signalled save: its hidden directory goes (a SIGKILLed one: at the next save)
        if engine.topology.global_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if engine.topology.global_rank == 0:
        swap_in(tmp, path)
        log.info("SlideDP checkpoint (step %d, %d ranks) written to %s", engine.step, _job_size(engine), path)
    _barrier(engine)


def refuse_storage_options(storage_options: Any | None) -> None:
    """A distributed checkpoint is written by every rank with ``torch.distributed.checkpoint``, never through a
    ``CheckpointIO``: ``storage_options`` meant for one are refused, naming the way to use them."""
    if storage_options is not None:
        raise TypeError(
            "SlideDP's distributed checkpoints do not use a CheckpointIO: drop storage_options, or pass "
            "checkpoint_format='full'."
        )


def _checkpoint_bytes(engine: EngineView) -> int:
    """About what a checkpoint of ``engine`` takes on disk: every ledger tensor it stores."""
    names = list(engine.state.named_slots())
    views = list(engine.state.ledger_tensors(names).values()) + [v for *_, v in engine.state.disk_state_views(names)]
    nbytes = sum(v.numel() * v.element_size() for v in views)
    del views
    engine.state.release_disk_views()
    return nbytes


def _hf_configs(model) -> dict[str, dict]:
    """A transformers model's config and generation config (and a peft model's adapter configs), so that the
    checkpoint exports on its own."""
    out = {}
    for key, attr in (("hf_config", "config"), ("generation_config", "generation_config")):
        value = getattr(model, attr, None)
        if value is not None and hasattr(value, "to_dict"):
            out[key] = value.to_dict()
    return {**out, **peft_configs(model)}


def _check_moments(path: Path, engine: EngineView, reader: CheckedFileSystemReader) -> None:
    """Refuse a checkpoint that holds no Adam moments for parameters this run trains (they were frozen when it was
    saved); moments of parameters this run freezes are left unread."""
    stored = stored_pieces(path, dcp_metadata(path, reader))
    saved = {k.split("/", 1)[1] for k in stored if k.startswith("exp_avg/")}
    names = list(engine.state.named_slots())
    keys = list(engine.state.ledger_tensors(names)) + [k for k, *_ in engine.state.disk_state_views(names)]
    engine.state.release_disk_views()
    mine = {k.split("/", 1)[1] for k in keys if k.startswith("exp_avg/")}
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


def load(engine: EngineView, path: str | os.PathLike) -> dict[str, Any]:
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
    reader = CheckedFileSystemReader(path)  # DCP's metadata read once, by the first check
    check_files(path, expected, small, reader)  # every rank: a few small files, read by every rank anyway
    _check_moments(path, engine, reader)
    large = sorted(n for n in expected if n.endswith(".distcp"))
    digests: dict[str, int] | None = info.get(PIECES)
    verifier = None
    if digests is None and expected:  # an older save without piece digests: this rank's share of the files
        index, count = engine.topology.global_rank, _job_size(engine)
        verifier = Verifier(path, expected, share({n: expected[n][0] for n in large}, count)[index])
    checks = PieceChecks()
    engine.synchronize()
    engine.drop_resident()
    try:
        held = _held(engine, writing=True)
        with engine.state.disk_paging():
            read_ranges(path, held, _job_group(engine), digests=digests, checks=checks, reader=reader)
        del held  # views of the state file's mapping, if any: let go before engine.restored unmaps it
    except BaseException as err:  # a damaged file DCP tripped over: name it (a signal: at once, unchecked)
        problem = None
        if isinstance(err, (Exception, CheckpointException)) and expected:
            problem = verifier.result() if verifier else verify_files(path, expected, sorted(checks.files_read))
        if problem is not None:
            raise damaged(path, problem) from err
        raise
    if verifier is not None:
        problem = verifier.result()
    elif checks.problems:
        problem = checks.problems[0]
    else:  # pieces read in part (another rank count or host layout): their files whole
        problem = verify_files(path, expected, sorted(checks.unchecked_files & expected.keys()))
    problems = [p for p in _gather(engine, problem) if p is not None]
    if problems:
        raise damaged(path, problems[0])
    engine.restored(info["step"], info["buffers"])
    log.info(
        "SlideDP checkpoint %s (step %d, saved by %d ranks) loaded on %d ranks",
        path,
        info["step"],
        info["world_size"],
        _job_size(engine),
    )
    return meta
