"""Per-rank record of one run: step start times, per-step loss, device memory; written as ``result_rank{r}.json``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch


class Recorder:
    """Times every step from its start (``perf_counter`` for durations, ``time.time`` to line up with the
    host-memory samples of the parent process) and keeps this rank's loss of every step."""

    def __init__(self, out: str | Path, rank: int) -> None:
        self.out, self.rank = Path(out), rank
        self.starts: list[float] = []
        self.walls: list[float] = []
        self.losses: list[float] = []
        self.tokens: list[int] = []  # per step: the sum of this rank's token ids (a fingerprint of its data)
        self.extra: dict = {}
        self.end: float | None = None  # when the training steps ended (None: when ``write`` is called)
        self.end_wall: float | None = None
        self._shared_at_start = 0  # file + shared-memory RSS when the window started

    def steps_done(self) -> None:
        """The training steps are over; what follows (the trainer's teardown, writing results) is outside the
        window whose host-memory peak is reported."""
        self.end, self.end_wall = time.perf_counter(), time.time()
        self._private_peak()

    def _private_peak(self) -> None:
        """This rank's peak private memory in the training window (once, at its end): the kernel's high-water mark
        of the whole RSS less the file and shared-memory RSS at the end. The mark has no private part of its own,
        so where file or shared pages grew inside the window the peak may be under by that growth, recorded as
        ``private_peak_slack_bytes``."""
        if self.starts and "private_peak_bytes" not in self.extra:
            status = _status()
            shared = status["RssFile"] + status["RssShmem"]
            self.extra["private_peak_bytes"] = status["VmHWM"] - shared
            self.extra["private_peak_slack_bytes"] = max(0, shared - self._shared_at_start)

    def step_start(self) -> None:
        if not self.starts:  # the training window starts: the kernel's RSS high-water mark restarts from now
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                self.extra["private_peak_bytes"] = None
            status = _status()
            self._shared_at_start = status["RssFile"] + status["RssShmem"]
        self.starts.append(time.perf_counter())
        self.walls.append(time.time())

    def batch(self, ids: torch.Tensor) -> None:
        self.tokens.append(int(ids.sum()))

    def loss(self, value: float) -> None:
        self.losses.append(float(value))

    def write(self, device_memory: dict | None, device_note: str = "") -> None:
        self._private_peak()  # loops that do not mark the end of their steps: read at the write
        self.out.mkdir(parents=True, exist_ok=True)
        data = {
            "rank": self.rank,
            "starts": self.starts,
            "walls": self.walls,
            "end": self.end or time.perf_counter(),
            "end_wall": self.end_wall or time.time(),
            "losses": self.losses,
            "tokens": self.tokens,
            "device_memory": device_memory,
            "device_note": device_note,
            "pid": os.getpid(),
            **self.extra,
        }
        (self.out / f"result_rank{self.rank}.json").write_text(json.dumps(data))


def _status() -> dict[str, int]:
    """Bytes of this process's peak RSS since the last reset (``VmHWM``) and of its file and shared-memory RSS."""
    with open("/proc/self/status") as f:
        fields = (line.partition(":") for line in f)
        return {k: int(v.split()[0]) * 1024 for k, _, v in fields if k in ("VmHWM", "RssFile", "RssShmem")}


def cuda_peak() -> dict | None:
    """The CUDA caching allocator's peak (None on CPU: there is no device allocator to ask)."""
    if not torch.cuda.is_available():
        return None
    return {
        "max_allocated_bytes": torch.cuda.max_memory_allocated(),
        "max_reserved_bytes": torch.cuda.max_memory_reserved(),
    }


NO_DEVICE_ALLOCATOR = "no device allocator on CPU: the device is host memory, its bytes are in the host column"
