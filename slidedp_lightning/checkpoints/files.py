"""The files of a save: written to a hidden sibling of the target and swapped into place, each file hashed
(XXH3-64) and verified when read back, stale hidden saves of dead processes removed, a full disk named.

Shared by distributed checkpoints (:mod:`slidedp_lightning.checkpoints.distributed`) and Hugging Face exports
(:mod:`slidedp_lightning.hf.export`).
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

import torch
import xxhash

from slidedp_lightning.runtime.host_os import format_bytes, process_start_time

log = logging.getLogger(__name__)

_WINDOW = 64 << 20  # bytes of a file mapped and hashed at a time (a multiple of mmap.ALLOCATIONGRANULARITY)
CHECKSUMS = "files"  # meta.json's "slidedp" entry: {file name: [size, XXH3-64]} of every other file
# meta.json's "slidedp" entry: {stored piece (DCP key): XXH3-64 of its bytes}, checked on the piece as a resume
# reads it into the ledger (no second pass over the files)
PIECES = "pieces"
META_HASH = "meta_xxh3"  # meta.json's "slidedp" entry: XXH3-64 (16 hex digits) of the rest of meta.json's content


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


def tensor_digest(tensor: torch.Tensor) -> int:
    """XXH3-64 of the bytes of a contiguous tensor, read in place."""
    return xxhash.xxh3_64_intdigest(tensor.detach().reshape(-1).view(torch.uint8).numpy().data)


def sums(files: Iterable[Path]) -> dict[str, list[int]]:
    return {f.name: [f.stat().st_size, file_checksum(f)] for f in files}


def content_digest(doc: dict) -> str:
    """XXH3-64 (16 hex digits) of the JSON document ``doc`` (a checkpoint's ``meta.json``) without its own
    :data:`META_HASH`, over a canonical form (sorted keys, no whitespace, ASCII): the same whether computed on what a
    save writes or on what a resume parses back, so that any change to the content shows."""
    header = {k: v for k, v in doc["slidedp"].items() if k != META_HASH}
    body = json.dumps({**doc, "slidedp": header}, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return xxhash.xxh3_64_hexdigest(body.encode("ascii"))


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


def damaged(path: Path, problem: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"checkpoint {path} is damaged: {problem}; resume from another checkpoint.")


class Verifier:
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


def no_space(err: BaseException, where: Path) -> bool:
    """Whether a failed write ran out of disk space (torch's zip writer says only "file write failed"; DCP gives
    each rank's error in ``failures``). The error's causes, contexts and failures are searched too: they can form
    a cycle (an error raised while handling itself), so each is visited once."""
    seen: set[int] = set()
    todo: list[BaseException] = [err]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if _says_no_space(e, where):
            return True
        failures = [f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()]
        todo += [x for x in (*failures, e.__cause__, e.__context__) if isinstance(x, BaseException)]
    return False


def _says_no_space(err: BaseException, where: Path) -> bool:
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


def space_error(err: BaseException, path: Path, what: str, nbytes: int) -> OSError:
    """The one-line error of a save of ``what`` to ``path`` that ran out of disk space: the device's free bytes,
    about ``nbytes`` needed (left out when 0: not known), and the fix."""
    try:
        free = format_bytes(shutil.disk_usage(path.parent).free)
    except OSError:
        free = "unknown"
    needs = f", it takes about {format_bytes(nbytes)}" if nbytes > 0 else ""
    return OSError(
        errno.ENOSPC,
        f"{what} {path} not written: no space left on the device of {path.parent} ({free} free{needs}); free "
        "space there or write to another directory (the previous one is kept)",
    )


def write_target(path: Path) -> Path:
    """Where a save to ``path`` goes: ``path``, or the final target of the symbolic link it is."""
    if not path.is_symlink():
        return path
    target = Path(os.path.realpath(path))
    log.info("SlideDP checkpoint path %s is a symbolic link: writing the checkpoint at its target %s", path, target)
    return target


def hidden_sibling(path: Path, kind: str) -> Path:
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


def swap_in(tmp: Path, path: Path) -> None:
    """Put the finished ``tmp`` at ``path``; the previous checkpoint there goes only once it is replaced."""
    old = None
    if path.exists() or path.is_symlink():
        old = hidden_sibling(path, "old")
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
