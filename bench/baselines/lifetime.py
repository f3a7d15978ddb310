"""No benchmark process outlives the benchmark.

* Every job is started in a process group of its own and tracked here; :func:`end_group` takes the whole group
  down (after a grace period for ranks that are still writing their results), :func:`kill_tracked` kills every
  group still tracked (at interpreter exit and on interrupt).
* A job process calls :func:`die_with_parent` first: the kernel sends it SIGKILL when its parent dies, even when
  the parent was killed with SIGKILL and ran no cleanup (``PR_SET_PDEATHSIG``, Linux). Each process names itself
  the parent of its own children (:data:`PARENT_ENV`), so a rank started by a job dies with that job.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import sys
import time

log = logging.getLogger(__name__)

PARENT_ENV = "SLIDEDP_BENCH_PARENT_PID"  # the pid a job process must have as its parent
PR_SET_PDEATHSIG = 1
_TRACKED: set[int] = set()  # process group ids of running jobs


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Get ``sig`` when the parent process dies; exit at once if the parent named in :data:`PARENT_ENV` is already
    gone (the process was re-parented before the request took effect). Returns whether the kernel took the request
    (False off Linux)."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    expected = os.environ.get(PARENT_ENV)
    if expected and expected.isdigit() and os.getppid() != int(expected):
        os._exit(1)  # the parent died before the request: nobody is left to collect this job
    os.environ[PARENT_ENV] = str(os.getpid())  # the children of this process check for it in turn
    return armed


def track(pgid: int) -> None:
    """A job's process group is running (killed by :func:`kill_tracked` unless ended first)."""
    _TRACKED.add(pgid)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def end_group(pgid: int, grace_s: float = 0.0) -> bool:
    """Wait up to ``grace_s`` for the processes left in group ``pgid`` to exit, then kill the rest; untrack it.
    Returns whether processes had to be killed."""
    deadline = time.monotonic() + grace_s
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = group_alive(pgid)
    if left:
        kill_group(pgid)
    _TRACKED.discard(pgid)
    return left


def kill_tracked() -> list[int]:
    """Kill every tracked job group; returns their ids."""
    groups = sorted(_TRACKED)
    for pgid in groups:
        kill_group(pgid)
        _TRACKED.discard(pgid)
    if groups:
        log.warning("killed the process groups of unfinished benchmark jobs: %s", groups)
    return groups


def tracked() -> list[int]:
    return sorted(_TRACKED)


atexit.register(kill_tracked)
