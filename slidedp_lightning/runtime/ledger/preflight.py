"""Checks before a ledger is created: where it goes (``$SLIDEDP_SHM_DIR`` or /dev/shm, or private memory) and
whether the host has the memory for it."""

from __future__ import annotations

import os

from slidedp_lightning.runtime.host_os import format_bytes, mem_available
from slidedp_lightning.runtime.ledger.geometry import LedgerGeometry

SHM_ENV = "SLIDEDP_SHM_DIR"  # where ledgers are created (default /dev/shm); any local directory shared by the ranks


def shm_dir() -> str:
    """The directory ledgers are created in: ``$SLIDEDP_SHM_DIR``, checked to be a writable directory, or
    /dev/shm. A bad value raises an error that names the variable."""
    value = os.environ.get(SHM_ENV)
    if value is None:
        return "/dev/shm"
    if not value.strip():
        raise ValueError(f"{SHM_ENV} is set but empty; unset it (ledgers go to /dev/shm) or name a local directory.")
    if not os.path.isdir(value):
        what = "does not exist" if not os.path.exists(value) else "is not a directory"
        raise FileNotFoundError(
            f"{SHM_ENV}={value!r} {what}: SlideDP creates its host ledgers there. Point {SHM_ENV} at an existing local "
            "directory that every rank of the host can reach (a tmpfs such as /dev/shm is fastest), or unset it."
        )
    if not os.access(value, os.W_OK | os.X_OK):
        raise PermissionError(
            f"{SHM_ENV}={value!r} is not writable by this process (uid {os.getuid()}): SlideDP creates its host "
            f"ledgers there. Pick a directory it may create files in, or unset {SHM_ENV}."
        )
    return value


def ledger_directory(shared: bool) -> str | None:
    """Where a new ledger goes: a shared one (other local ranks open it) into :func:`shm_dir`; a private one into
    this process's own memory (None), which gets transparent huge pages where shared memory mostly does not, unless
    ``$SLIDEDP_SHM_DIR`` names a directory for every ledger."""
    return shm_dir() if shared or SHM_ENV in os.environ else None


def _where_ledgers_go(err: OSError) -> OSError:
    """``err`` (creating the ledger file) again, saying where the directory came from."""
    source = (
        f"{SHM_ENV}={os.environ[SHM_ENV]!r}" if SHM_ENV in os.environ else f"the default /dev/shm ({SHM_ENV} unset)"
    )
    return type(err)(err.errno, f"SlideDP cannot create its host ledger in {source}: {err.strerror}")


class HostMemoryError(MemoryError):
    """The host cannot hold the ledger."""


def available_host_bytes(directory: str | None = "") -> tuple[int, int]:
    """(MemAvailable, free bytes in the ledger ``directory``: by default :func:`shm_dir`; None, a private ledger:
    MemAvailable again)."""
    mem = mem_available()
    if directory is None:
        return mem, mem
    st = os.statvfs(directory or shm_dir())
    return mem, st.f_bavail * st.f_frsize


def check_host_memory(geometry: LedgerGeometry, num_params: int, copies: float = 1, directory: str | None = "") -> None:
    """Fail fast, before anything is allocated, when ``copies`` ledgers (a fraction for a host-sharded ledger,
    which only ever touches its share of the file) cannot fit in host memory and in their ``directory`` (see
    :func:`available_host_bytes`)."""
    need = int(geometry.nbytes * copies)
    mem, shm = available_host_bytes(directory)
    have = min(mem, shm)
    if need > have:
        private = directory is None  # the process's own memory: only MemAvailable counts
        where = f"MemAvailable {format_bytes(mem)}" + ("" if private else f", {shm_dir()} free {format_bytes(shm)}")
        fix = (
            "Free host memory"
            if private
            else f"Free host memory, enlarge {shm_dir()} (mount -o remount,size=...) or point {SHM_ENV} at a local "
            "directory with room"
        )
        raise HostMemoryError(
            f"SlideDP needs {format_bytes(need)} of host {'' if private else 'shared '}memory for "
            + (
                f"{copies} ledgers (param_route='replicated': one per rank) "
                if copies > 1
                else "the ledger "
                if copies == 1
                else f"this host's {copies:.3g} of the ledger "
            )
            + f"({geometry.nbytes / max(num_params, 1):.1f} B/param x {num_params:,} params, padding included"
            + (f" + {format_bytes(geometry.staging_bytes)} host_reduce staging" if geometry.staging_bytes else "")
            + f"), but only {format_bytes(have)} is available ({where}). {fix}"
            + ("; param_route='full' or 'sharded' keeps one ledger per host" if copies > 1 else "")
            + ("; grad_route='gpu_reduce' needs no staging slots" if geometry.staging_bytes else "")
            + "."
        )
