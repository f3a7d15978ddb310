"""Waiting on stamps written by other processes, without ever hanging on a dead one."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class PeerFailure(RuntimeError):
    """Another rank of this job died or failed; this rank cannot go on."""


@dataclass
class Liveness:
    """Checks that the ranks of this host are alive, and bounds every wait by the job's timeout."""

    pids: Callable[[], list[int]]
    timeout_s: float
    own_error: Callable[[], BaseException | None] = lambda: None
    _last_check: float = field(default=0.0, init=False)

    def check(self, what: str, started: float) -> None:
        err = self.own_error()
        if err is not None:
            raise PeerFailure(f"the update lane of this rank failed while waiting for {what}") from err
        now = time.monotonic()
        if now - self._last_check > 0.2:
            self._last_check = now
            for rank, pid in enumerate(self.pids()):
                if pid > 0 and not _pid_alive(pid):
                    raise PeerFailure(
                        f"rank {rank} (pid {pid}) of this host died while this rank waited for {what}; stopping."
                    )
        if now - started > self.timeout_s:
            stuck = peer_states(self.pids()) or "a peer rank is stuck"
            raise PeerFailure(f"timed out after {self.timeout_s:.0f} s waiting for {what}; {stuck}.")


_STATES = {"T": "stopped (SIGSTOP or a job-control stop)", "t": "stopped by a debugger", "D": "in uninterruptible I/O"}


def peer_states(pids: list[int]) -> str:
    """The ranks of ``pids`` (indexed by rank, 0 = not watched) that cannot be making progress, e.g. "rank 1 (pid
    4242) is stopped (SIGSTOP or a job-control stop)"; empty when every one runs or sleeps normally."""
    out = []
    for rank, pid in enumerate(pids):
        if pid <= 0:
            continue
        if not _pid_alive(pid):
            out.append(f"rank {rank} (pid {pid}) of this host is dead")
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state in _STATES:
            out.append(f"rank {rank} (pid {pid}) of this host is {_STATES[state]}")
    return "; ".join(out)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (killed, not yet reaped by its parent) counts as dead
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(predicate: Callable[[], bool], liveness: Liveness, what: str) -> None:
    """Poll ``predicate`` with a growing sleep (20 us .. 1 ms) until true; raise if a peer dies or time runs out."""
    if predicate():
        return
    started = time.monotonic()
    delay = 2e-5
    while not predicate():
        liveness.check(what, started)
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)


# Test-only fault injection: a random sleep at every lane hand-off exposes a missing wait as a changed
# result. Off (0) unless SLIDEDP_TEST_LANE_DELAY_MS is set when an engine starts.
_lane_delay_s = 0.0
_rng = random.Random(0)


def set_lane_delay(max_ms: float) -> None:
    global _lane_delay_s
    _lane_delay_s = max(0.0, max_ms) / 1e3


def lane_delay() -> None:
    """Sleep a random 0..max delay when fault injection is on; otherwise return at once."""
    if _lane_delay_s:
        time.sleep(_rng.uniform(0.0, _lane_delay_s))
