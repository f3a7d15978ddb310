"""The job's peak host memory: the launching process samples the proportional set size (PSS) of itself and of the
rank processes it started, summed, while the fit runs.

PSS counts each private page once and each shared page (the ledger's, the libraries') split among the processes
that map it, so the sum over the job's processes is the host memory the job holds, the ledger counted once. A
sample every ``interval_s`` misses a peak shorter than that. Ranks started by another launcher (torchrun, srun) are
not this process's children; the count of processes seen says what was measured.
"""

from __future__ import annotations

import os
import threading

import lightning.pytorch as L

from slidedp_lightning.runtime.host_os import process_children


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    out, frontier = [root], [root]
    while frontier:
        kids = process_children(frontier.pop())
        out += kids
        frontier += kids
    return out


def pss_bytes(pid: int) -> int:
    """The process's proportional set size (0 once it is gone, or where ``smaps_rollup`` cannot be read)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return sum(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
    except (OSError, ValueError, IndexError):
        return 0


class PeakHostMemory(L.Callback):
    """``peak_bytes``: the largest summed PSS of this process's tree seen during ``fit`` (sampled in the launching
    process only; elsewhere ``None``); ``processes``: how many processes the largest sample covered."""

    def __init__(self, launching: bool, interval_s: float = 0.25) -> None:
        self.launching, self.interval_s = launching, interval_s
        self.peak_bytes: int | None = None
        self.processes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while True:
            pids = process_tree(os.getpid())
            total = sum(pss_bytes(pid) for pid in pids)
            if total > (self.peak_bytes or 0):
                self.peak_bytes, self.processes = total, len(pids)
            if self._stop.wait(self.interval_s):
                return

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
