"""bench.baselines.record: the exact private peak of a rank's training window."""

from __future__ import annotations

import numpy as np

from bench.baselines.record import Recorder


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def test_private_peak_catches_memory_freed_before_the_window_ends(tmp_path):
    before = np.ones(128 << 20, dtype=np.uint8)  # touched before the window: in the high-water mark until reset
    del before
    rec = Recorder(tmp_path, rank=0)
    rec.step_start()  # the window starts: the high-water mark restarts here
    floor = _rss_anon()
    transient = np.ones(48 << 20, dtype=np.uint8)  # 48 MiB touched, then freed inside the window
    del transient
    rec.steps_done()
    peak = rec.extra["private_peak_bytes"]
    # file pages another thread maps inside the window lower the reported peak by up to their growth (the slack)
    slack = rec.extra["private_peak_slack_bytes"]
    assert peak + slack >= floor + (48 << 20) - (4 << 20), "the transient allocation is part of the peak"
    assert peak <= floor + (48 << 20) + (24 << 20), "memory touched before the window is not"
