"""CPU thread budgets for the Numba kernels (one budget per local rank, no oversubscription)."""

from __future__ import annotations

import logging
import os
import threading
from numbers import Integral

import numba

__all__ = ["logical_cpus", "physical_cores", "thread_budget", "set_kernel_threads", "start_kernel_pool"]

log = logging.getLogger(__name__)

_CPUINFO = "/proc/cpuinfo"


def _allowed_cpus() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _core_ids(cpuinfo: str) -> dict[int, tuple[str, str]]:
    """Map logical CPU -> (physical id, core id) from /proc/cpuinfo text (missing ids skipped)."""
    cores: dict[int, tuple[str, str]] = {}
    for block in cpuinfo.split("\n\n"):
        fields = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        if "processor" in fields and "core id" in fields and fields["processor"].isdigit():
            cores[int(fields["processor"])] = (fields.get("physical id", "0"), fields["core id"])
    return cores


def count_physical_cores(cpuinfo: str, allowed: set[int] | None) -> int | None:
    """Distinct (socket, core) pairs among ``allowed`` CPUs, or None if cpuinfo lacks core ids."""
    cores = _core_ids(cpuinfo)
    cpus = allowed if allowed is not None else set(cores)
    if not cpus or not cpus <= cores.keys():
        return None
    return len({cores[cpu] for cpu in cpus})


def logical_cpus() -> int:
    """Logical CPUs this process may run on (``os.sched_getaffinity``; else ``os.cpu_count()``)."""
    allowed = _allowed_cpus()
    return len(allowed) if allowed else (os.cpu_count() or 1)


def physical_cores() -> int:
    """Physical cores this process may run on (affinity-aware; SMT siblings count once).

    Uses the ``core id``/``physical id`` fields of /proc/cpuinfo for the CPUs in
    ``os.sched_getaffinity``; falls back to the number of allowed logical CPUs, then to
    ``os.cpu_count()``.
    """
    allowed = _allowed_cpus()
    try:
        with open(_CPUINFO, encoding="utf-8", errors="replace") as f:
            cores = count_physical_cores(f.read(), allowed)
    except OSError:
        cores = None
    if cores is None:
        cores = logical_cpus()
        log.debug("no core ids in %s; counting %d logical CPUs as cores", _CPUINFO, cores)
    return max(1, cores)


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def thread_budget(local_world_size: int, override: int | None = None) -> int:
    """Kernel threads per rank: ``physical_cores() // local_world_size`` (at least 1).

    ``override`` (e.g. from a config option) wins when given; it must be an int >= 1.
    """
    local_world_size = _check_count("local_world_size", local_world_size)
    if override is not None:
        return _check_count("override (thread budget)", override)
    return max(1, physical_cores() // local_world_size)


def set_kernel_threads(n: int) -> None:
    """Set the Numba kernel threads for the calling thread, clamped to NUMBA_NUM_THREADS."""
    n = _check_count("n (kernel threads)", n)
    limit = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]  # numba.core.config sets it via globals()
    if n > limit:
        log.warning("requested %d kernel threads, clamping to NUMBA_NUM_THREADS=%d", n, limit)
        n = limit
    numba.set_num_threads(n)


def start_kernel_pool() -> None:
    """Start Numba's kernel threads from a short-lived thread of their own (nothing to do once they run).

    Numba's OpenMP layer sets the OpenMP thread count of the thread that starts its pool (the first call of
    ``numba.get_num_threads``, ``set_num_threads`` or a parallel kernel) to ``NUMBA_NUM_THREADS``, and torch's CPU
    operators on that thread read the same count. Started from a training thread, the pool would leave that
    thread's forward and backward on every core of the host, beside the host's other ranks."""
    starter = threading.Thread(target=numba.get_num_threads, name="numba-pool-start")
    starter.start()
    starter.join()
