"""Host memory of a job's process tree, sampled from ``/proc`` in the parent process.

Counted: the sum over every process of the job of ``Pss`` from ``/proc/<pid>/smaps_rollup`` (proportional set
size). A page mapped by k processes counts 1/k in each, so the shared ledger in ``/dev/shm`` is counted once in
total however many ranks map it, a private ledger per rank is counted per rank, and shared library pages count
only the job's share. ``Pss_Shmem`` (shared-memory part) and the plain ``Rss`` sum (which counts shared pages
once per process) are kept beside it. Peaks are the maximum of samples taken every ``interval`` seconds
(:data:`INTERVAL_S` for every system of the benchmark), or less often where a sample costs more than
``max_share`` of the wait (:data:`MAX_SHARE`): the sampler takes at most that share of one core from the job it
measures. One sample reads the processes one after the other and can take a large part of a second on a loaded
machine: it carries the instants its reading began and ended, and belongs to a time window only when both lie
inside it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from slidedp_lightning.recipes.host_memory import SamplingPace
from slidedp_lightning.runtime.host_os import process_tree

FIELDS = ("Rss", "Pss", "Pss_Shmem", "Pss_Anon")
# Sampling period of every benchmark job. One pass reads ``smaps_rollup`` of each process, a walk of its page
# tables (about 7 ms of CPU per rank process of 1 GB on the 2-core machine). Measured there: 0.1 s cost ~15 %
# of one core, 0.02 s about a third of one core and slower steps; 0.05 s gives the shortest training window
# (~1 s) about twice the samples of 0.1 s.
INTERVAL_S = 0.05
# The most of one core the sampler takes: a capacity job's ranks map 10+ GB each, and reading their smaps_rollup
# took ~0.2 s a sample, so at INTERVAL_S the sampler ran ~2/3 of a core (measured: 67 % beside a 44-layer job on the
# 2-core machine, whose steps were core-bound). Small jobs (~7 ms a process) keep sampling every ~0.05-0.1 s.
MAX_SHARE = 0.25


@dataclass(frozen=True)
class Sample:
    wall: float  # time.time() when the reading began
    pss: int
    rss: int
    pss_shmem: int
    procs: int
    wall_end: float = 0.0  # time.time() when the last process was read (0: same as wall)


def rollup(pid: int) -> dict[str, int]:
    """Bytes of the ``FIELDS`` of one process (empty if it is gone)."""
    got: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in FIELDS:
                    got[key] = int(rest.split()[0]) * 1024
    except OSError:
        return {}
    return got


def sample(root: int) -> Sample:
    t0 = time.time()
    pss = rss = shm = n = 0
    for pid in process_tree(root):
        r = rollup(pid)
        if r:
            n += 1
            pss, rss, shm = pss + r.get("Pss", 0), rss + r.get("Rss", 0), shm + r.get("Pss_Shmem", 0)
    return Sample(t0, pss, rss, shm, n, time.time())


class Sampler(threading.Thread):
    """Samples the tree under ``root`` until stopped; calls ``on_limit`` once if PSS exceeds ``limit`` bytes.

    Waits ``max(interval, CPU seconds of the last sample / max_share)`` between samples; ``longest_wait_s`` is the
    longest of those waits."""

    def __init__(
        self,
        root: int,
        interval: float = INTERVAL_S,
        limit: int | None = None,
        on_limit: Callable[[Sample], None] | None = None,
        max_share: float = MAX_SHARE,
    ) -> None:
        self._pace = SamplingPace(interval, max_share)
        super().__init__(daemon=True)
        self.root, self.limit, self.on_limit = root, limit, on_limit
        self.samples: list[Sample] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            cpu = time.thread_time()
            s = sample(self.root)
            wait = self._pace.after(time.thread_time() - cpu)
            self.samples.append(s)
            if self.limit and s.pss > self.limit and self.on_limit is not None:
                self.on_limit(s)
                self.on_limit = None
            self._halt.wait(wait)

    @property
    def longest_wait_s(self) -> float:
        return self._pace.longest_s

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def peak(self, start: float = 0.0, end: float = float("inf")) -> Sample | None:
        """The sample with the largest PSS among those read entirely between two ``time.time()`` instants."""
        inside = [s for s in self.samples if start <= s.wall and max(s.wall, s.wall_end) <= end]
        return max(inside, key=lambda s: s.pss) if inside else None


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0
