"""The state file's disk rate as a traced run got it (``steptime disk``): the bytes of every rank's disk spans over
the time any rank had a read or write under way, the ranks' traces laid on one clock."""

import json

import pytest

from slidedp_lightning.runtime.trace import Tracer
from slidedp_lightning.steptime.__main__ import main
from slidedp_lightning.steptime.calibrate import with_disk
from slidedp_lightning.steptime.profiles import Profile, load_profile
from slidedp_lightning.steptime.traces import disk_rate
from tests.steptime.test_loop import _machine

MB = 10**6


def _trace(path, steps: int = 5, bytes_field: bool = True) -> None:
    """Two ranks, each its own clock origin (a process's start): per 100 ms step, rank 0 reads 100 MB over
    [0, 10) ms and rank 1 writes 50 MB over [5, 15) ms (together: 150 MB in 15 ms of disk time); in odd steps rank 1
    writes over [20, 30) ms instead (150 MB in 20 ms)."""
    for r in range(2):
        t = Tracer(str(path), r)
        t.origin = 50.0 + 30.0 * r
        for k in range(steps):
            s = 100.0 + 0.1 * k
            t.record("compute", "forward", k, s, s + 0.05)
            if r == 0:
                t.record("disk", "read", k, s, s + 0.010, 3, nbytes=100 * MB if bytes_field else 0)
            else:
                w = s + (0.020 if k % 2 else 0.005)
                t.record("disk", "write", k, w, w + 0.010, 3, nbytes=50 * MB if bytes_field else 0)
            t.mark_step(k, s, s + 0.09)
        t.close()


def test_the_disk_rate_of_a_traced_run_is_its_bytes_over_the_time_any_rank_used_the_disk(tmp_path):
    _trace(tmp_path)
    rate, seen = disk_rate(tmp_path, skip=1)  # steps 1-4: 15, 20, 15, 20 ms for 150 MB
    assert seen["steps"] == 4 and seen["bytes"] == 150 * MB
    assert seen["busy_s"] == pytest.approx(0.0175, abs=1e-6)
    assert rate == pytest.approx((10e9 + 7.5e9) / 2, rel=1e-6)  # the median of 10, 7.5, 10 and 7.5 GB/s
    assert disk_rate(tmp_path, skip=0)[1]["steps"] == 5


def test_traces_without_bytes_or_disk_spans_are_refused(tmp_path):
    _trace(tmp_path / "old", bytes_field=False)
    with pytest.raises(ValueError, match="trace the run again"):
        disk_rate(tmp_path / "old")
    _trace(tmp_path / "short", steps=2)
    with pytest.raises(ValueError, match="no disk spans after skipping 2"):
        disk_rate(tmp_path / "short")
    with pytest.raises(FileNotFoundError):
        disk_rate(tmp_path / "none")


def test_with_disk_and_the_cli_set_the_profiles_disk_to_the_traced_rate(tmp_path, capsys):
    _trace(tmp_path / "run")
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(_machine(disk_gbps=1.3).to_json()))
    got = with_disk(load_profile(prof), tmp_path / "run")
    assert got.values["disk_gbps"] == pytest.approx(10.0, rel=1e-6)  # steps 2-4: 10, 7.5 and 10 GB/s
    assert (
        got.sources["disk_gbps"].startswith("probe: lane traces") and "probe had 1.30 GB/s" in got.sources["disk_gbps"]
    )
    assert isinstance(got, Profile) and got.values["link_gbps"] == 0.5  # the rest as it was
    out = tmp_path / "q.json"
    assert main(["disk", "--profile", str(prof), "--trace", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert load_profile(out).values["disk_gbps"] == pytest.approx(got.values["disk_gbps"])
    assert load_profile(prof).values["disk_gbps"] == 1.3 and "disk_gbps = " in capsys.readouterr().out
    assert main(["disk", "--profile", str(prof), "--trace", str(tmp_path / "none")]) == 2
