"""Small operating-system helpers: byte formatting, glibc heap trim, MemAvailable, process state, start time and
trees from /proc. Plain Python (the standard library only): ``slidedp-finetune``'s plan reads it before torch is
imported."""

from __future__ import annotations

import os


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit up to GiB that keeps the number at least 1: "512 B", "1.50 KiB",
    "3.00 MiB", "1490.12 GiB"."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def mem_available() -> int:
    """The kernel's estimate of the memory available to new work (``MemAvailable``), bytes; 0 where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def trim_host_heap() -> bool:
    """Give freed heap memory back to the OS (glibc ``malloc_trim``); False where there is no glibc.

    Building a model and then replacing its parameters by streamed buffers frees about 4 B/param per rank,
    which glibc otherwise keeps in its arenas: the process would hold it for the whole run."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def _stat_field(pid: int, index: int) -> str | None:
    """Field ``index`` of /proc/<pid>/stat after the command name (0: the state), None when ``pid`` is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[index]
    except (OSError, IndexError):
        return None


def process_start_time(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (with the pid, an identity that survives pid reuse)."""
    return _stat_field(pid, 19)


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` in /proc (R, S, D, T, t, Z, ...), None when it is gone."""
    return _stat_field(pid, 0)


def process_children(pid: int) -> list[int]:
    """The pids of ``pid``'s children (those its main thread started), [] when it is gone."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(k) for k in f.read().split()]
    except OSError:
        return []


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it: the children any of each process's threads started (a process gone
    while it is read keeps its place, without children)."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out
