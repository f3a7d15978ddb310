"""bench.baselines.record: the exact private peak of a rank's training window."""

from __future__ import annotations

import mmap

import numpy as np

from bench.baselines.record import Recorder


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def _touch_fresh_pages(nbytes: int) -> None:
    """Touch ``nbytes`` of new anonymous pages, then unmap them. A mapping of its own, not ``malloc``: the allocator
    may serve a large request from heap pages still resident from earlier work in this process (then nothing new is
    touched, and the peak rightly does not grow)."""
    with mmap.mmap(-1, nbytes) as pages:
        view = np.frombuffer(pages, dtype=np.uint8)
        view[:] = 1
        del view


def test_private_peak_catches_memory_freed_before_the_window_ends(tmp_path):
    _touch_fresh_pages(128 << 20)  # before the window: in the high-water mark until it is reset
    rec = Recorder(tmp_path, rank=0)
    rec.step_start()  # the window starts: the high-water mark restarts here
    floor = _rss_anon()
    _touch_fresh_pages(48 << 20)  # 48 MiB touched, then freed inside the window
    rec.steps_done()
    peak = rec.extra["private_peak_bytes"]
    # file pages another thread maps inside the window lower the reported peak by up to their growth (the slack)
    slack = rec.extra["private_peak_slack_bytes"]
    assert peak + slack >= floor + (48 << 20) - (4 << 20), "the transient allocation is part of the peak"
    assert peak <= floor + (48 << 20) + (24 << 20), "memory touched before the window is not"
