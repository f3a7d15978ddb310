"""The job's peak host memory: the launching process samples the proportional set size (PSS) of itself and of the
rank processes it started, summed, while the fit runs.

PSS counts each private page once and each shared page (the ledger's, the libraries') split among the processes
that map it, so the sum over the job's processes is the host memory the job holds, the ledger counted once. A
sample every ``interval_s`` misses a peak shorter than that. Reading a process's PSS walks its page tables (16 ms
for a process with torch loaded and 256 MiB touched, more the more it maps), so the sampler waits longer when a
sample costs more than ``max_share`` of the wait: it takes at most that share of one core. Ranks started by another
launcher (torchrun, srun) are not this process's children; the count of processes seen says what was measured.
"""

from __future__ import annotations

import os
import threading
import time

import lightning.pytorch as L

from slidedp_lightning.runtime.host_os import process_tree


def pss_bytes(pid: int) -> int:
    """The process's proportional set size (0 once it is gone, or where ``smaps_rollup`` cannot be read)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return sum(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
    except (OSError, ValueError, IndexError):
        return 0


class SamplingPace:
    """How long a sampler waits after each sample: ``interval_s``, or longer where the sample's CPU time would make
    sampling take more than ``max_share`` of one core. ``longest_s``: the longest wait so far."""

    def __init__(self, interval_s: float, max_share: float) -> None:
        if not 0 < max_share <= 1:
            raise ValueError(f"max_share={max_share}: a share of one core, in (0, 1]")
        self.interval_s, self.max_share, self.longest_s = interval_s, max_share, 0.0

    def after(self, sample_cpu_s: float) -> float:
        """The wait after a sample that took ``sample_cpu_s`` seconds of this thread's CPU."""
        wait = max(self.interval_s, sample_cpu_s / self.max_share)
        self.longest_s = max(self.longest_s, wait)
        return wait


class PeakHostMemory(L.Callback):
    """``peak_bytes``: the largest summed PSS of this process's tree seen during ``fit`` (sampled in the launching
    process only; elsewhere ``None``); ``processes``: how many processes the largest sample covered;
    ``longest_wait_s``: the longest wait between two samples."""

    def __init__(self, launching: bool, interval_s: float = 0.25, max_share: float = 0.02) -> None:
        self.launching, self._pace = launching, SamplingPace(interval_s, max_share)
        self.peak_bytes: int | None = None
        self.processes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while True:
            start = time.thread_time()
            pids = process_tree(os.getpid())
            total = sum(pss_bytes(pid) for pid in pids)
            if total > (self.peak_bytes or 0):
                self.peak_bytes, self.processes = total, len(pids)
            if self._stop.wait(self._pace.after(time.thread_time() - start)):
                return

    @property
    def longest_wait_s(self) -> float:
        return self._pace.longest_s

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.launching and self._thread is None:
            self.peak_bytes, self._stop = 0, threading.Event()
            self._thread = threading.Thread(target=self._sample, name="host-memory-peak", daemon=True)
            self._thread.start()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.stop()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
