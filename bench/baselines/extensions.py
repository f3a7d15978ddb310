"""Where DeepSpeed's JIT-built ops are built for the benchmark, and the build locks that block them.

``torch.utils.cpp_extension`` guards each extension's build directory with a file named ``lock`` (a "baton":
created with ``O_EXCL``, removed when the build ends). A process killed during a build leaves it behind, and
every later build of that extension waits for it to disappear, forever and silently. The benchmark therefore
builds in a directory of its own (:func:`owned_dir`), serialized by an ``flock`` that dies with its holder
(:class:`OwnedBuildDir`): whoever holds the flock knows that no benchmark build is running there, so any
``lock`` file it finds is stale and is removed, by name. Locks in torch's default directory are only reported
(:func:`find_locks`): other programs build there.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BATON = "lock"  # torch.utils.cpp_extension.FileBaton's file in each extension's build directory
FLOCK = ".slidedp-bench.flock"
OWNED_ENV = "SLIDEDP_BENCH_EXTENSIONS_DIR"  # overrides the benchmark's build directory


def _cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def default_dir() -> Path:
    """torch's default extensions directory (``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``)."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or _cache_home() / "torch_extensions")


def owned_dir() -> Path:
    """The benchmark's own extensions directory (kept between runs, so an op is built once per machine)."""
    return Path(os.environ.get(OWNED_ENV) or _cache_home() / "slidedp-bench" / "torch_extensions")


@dataclass(frozen=True)
class BuildLock:
    path: Path
    age_s: float

    def describe(self) -> str:
        return f"{self.path} (left {self.age_s / 60:.1f} min ago)"


def find_locks(root: Path, now: float | None = None) -> list[BuildLock]:
    """Every build lock under ``root``, oldest first."""
    now = time.time() if now is None else now
    found = []
    if root.is_dir():
        for path in root.glob(f"**/{BATON}"):
            try:
                found.append(BuildLock(path, max(0.0, now - path.stat().st_mtime)))
            except OSError:
                continue  # removed meanwhile
    return sorted(found, key=lambda lock: -lock.age_s)


def stale_lock_note(locks: list[BuildLock], where: Path) -> str:
    """The report's line about build locks found in another program's extensions directory ("" if none)."""
    if not locks:
        return ""
    names = "; ".join(lock.describe() for lock in locks)
    return (
        f"build lock(s) in {where}: {names}. torch waits without end for such a file before building that "
        "extension; it is stale unless a build is running now (then delete it). The benchmark builds DeepSpeed's "
        f"ops in its own directory, {owned_dir()}, and is not blocked by it"
    )


class OwnedBuildDir:
    """Hold the benchmark's extensions directory: an ``flock`` (released by the kernel if the holder dies) on a
    file that names the holder's pid. While it is held, every build lock inside is stale."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or owned_dir()
        self._fd: int | None = None

    def holder(self) -> str:
        try:
            return (self.root / FLOCK).read_text().strip() or "unknown"
        except OSError:
            return "unknown"

    def acquire(self, timeout_s: float, on_wait: Callable[[str], None] | None = None, every_s: float = 30.0) -> None:
        """Take the flock, waiting at most ``timeout_s`` (``on_wait`` hears who holds it, every ``every_s``)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / FLOCK, os.O_RDWR | os.O_CREAT, 0o644)
        start = last = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                if waited >= timeout_s:
                    os.close(fd)
                    raise TimeoutError(
                        f"another benchmark (pid {self.holder()}) holds {self.root / FLOCK} for {waited:.0f} s"
                    ) from None
                if on_wait is not None and time.monotonic() - last >= every_s:
                    last = time.monotonic()
                    on_wait(f"waiting for pid {self.holder()}, which builds in {self.root} ({waited:.0f} s)")
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def clear_stale(self) -> list[BuildLock]:
        """Remove (and return) the build locks inside: stale, since this process holds the directory."""
        assert self._fd is not None, "acquire() first"
        removed = []
        for lock in find_locks(self.root):
            try:
                lock.path.unlink()
                removed.append(lock)
            except FileNotFoundError:
                continue
        return removed

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> OwnedBuildDir:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
