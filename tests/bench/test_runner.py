"""bench.baselines.runner: a job that fails while the kernel's OOM killer kills a process is ``oom`` (a model that
does not fit), any other failure stays ``failed``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.baselines import runner
from bench.baselines.runner import oom_kills, run_job
from bench.configs import plan, scale


def test_the_oom_kill_counter_reads_as_a_count() -> None:
    kills = oom_kills()
    if kills is None:
        pytest.skip("/proc/vmstat has no oom_kill here")
    assert kills >= 0


@pytest.mark.parametrize("killed", [True, False])
def test_a_job_that_fails_while_the_oom_killer_kills_does_not_fit(tmp_path: Path, monkeypatch, killed: bool) -> None:
    counts = iter([7, 8 if killed else 7])  # before the job, after it
    monkeypatch.setattr(runner, "oom_kills", lambda: next(counts))
    real_popen = subprocess.Popen

    def popen(args, **kw):  # a job whose rank 0 fails because its peer was killed
        return real_popen([sys.executable, "-c", "import sys; print('rank 1 died'); sys.exit(1)"], **kw)

    monkeypatch.setattr(runner.subprocess, "Popen", popen)
    spec = next(r.spec for j in plan(scale("cpu"), tmp_path, init=lambda s, q, r: r / "x.pt") for r in j.runs)
    (res,) = run_job([("systems/x/ddp", spec)], tmp_path / "job", preflight=False)
    if killed:
        assert res.status == "oom" and "OOM killer stopped 1 process" in res.reason and "rank 1 died" in res.reason
    else:
        assert res.status == "failed" and res.reason.startswith("exit code 1") and "OOM" not in res.reason
