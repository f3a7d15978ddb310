"""A script-launched job's other local ranks, started before the launching process imports Lightning
(:mod:`slidedp_lightning.process.early_ranks`), are the ranks its script launcher runs
(:mod:`slidedp_lightning.process.launcher`), with the environment the launcher gives; they end, quietly, when the
launcher ends without them, and die with it; where the launcher's command is not theirs it starts its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slidedp_lightning.process import early_ranks
from slidedp_lightning.process.signals import process_state

JOB = Path(__file__).with_name("early_job.py")


def _run(tmp_path: Path, ranks: int, mode: str) -> tuple[subprocess.CompletedProcess, list[dict], list[dict]]:
    """Run the job; returns it, what each process wrote when it started, and what each one reported (rank order)."""
    env = {k: v for k, v in os.environ.items() if early_ranks.launching_here({k: v}) and k != early_ranks.ENV}
    proc = subprocess.run(
        [sys.executable, str(JOB), str(ranks), mode, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    deadline = time.monotonic() + 30  # a rank that outlives rank 0 has until then to end
    pids = [int(p.stem) for p in tmp_path.glob("*.start")]
    while time.monotonic() < deadline and any(process_state(pid) not in (None, "Z") for pid in pids):
        time.sleep(0.05)
    alive = [pid for pid in pids if process_state(pid) not in (None, "Z")]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"processes of the job outlived it: {alive}"
    starts = {int(p.stem): json.loads(p.read_text()) for p in tmp_path.glob("*.start")}
    reports = sorted((json.loads(p.read_text()) | {"pid": int(p.stem)} for p in tmp_path.glob("*.json")),
                     key=lambda r: r["local_rank"])  # fmt: skip
    return proc, [starts[pid] | {"pid": pid} for pid in sorted(starts)], reports


@pytest.mark.slow
def test_the_launcher_runs_the_ranks_started_before_its_imports_with_its_environment(tmp_path):
    proc, starts, reports = _run(tmp_path, 3, "launch")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["local_rank"] for r in reports] == [0, 1, 2], reports
    rank0, *others = reports
    assert [r["pid"] for r in others] == rank0["children"] and rank0["codes"] == [0, 0]
    assert len(starts) == 3  # no process but these three
    for rank, report in enumerate(others, start=1):
        assert report["early"] and report["started"] < rank0["imported"], (report, rank0)  # overlapped its imports
        assert report["env"] == {"LOCAL_RANK": str(rank), "WORLD_SIZE": "3", "NODE_RANK": "0",
                                 "MASTER_PORT": rank0["env"]["MASTER_PORT"], early_ranks.ENV: None}  # fmt: skip
    assert rank0["env"]["LOCAL_RANK"] == "0" and rank0["env"]["MASTER_PORT"] is not None and not rank0["early"]


@pytest.mark.slow
def test_a_launcher_with_another_command_starts_its_own_ranks_and_the_early_ones_end(tmp_path):
    proc, starts, reports = _run(tmp_path, 2, "changed-command")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = reports
    assert rank0["codes"] == [0] and rank1["pid"] == rank0["children"][0] and not rank1["early"]
    early = [s for s in starts if s["early"]]
    assert len(early) == 1 and early[0]["pid"] != rank1["pid"]  # ended without a report: it was never launched
    assert proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("mode", ["exit", "killed"])
def test_ranks_started_early_end_with_a_launcher_that_ends_without_them(tmp_path, mode):
    proc, starts, reports = _run(tmp_path, 2, mode)
    assert proc.returncode == (0 if mode == "exit" else -signal.SIGKILL), proc.stderr[-3000:]
    assert [s["early"] for s in starts].count(True) == 1  # (_run checked that no process outlived the job)
    assert [r["local_rank"] for r in reports] == ([0] if mode == "exit" else [])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_only_a_process_no_other_launcher_started_launches(monkeypatch):
    assert early_ranks.launching_here({"PATH": "/bin"})
    for name in ("LOCAL_RANK", "RANK", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_SIZE"):
        assert not early_ranks.launching_here({name: "1"}), name
    monkeypatch.delenv(early_ranks.ENV, raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    early_ranks.begin(1)  # one rank: nothing to start
    assert not early_ranks.started(early_ranks.script_command(), 0)
    early_ranks.wait_for_launch()  # not started early: returns at once
    with pytest.raises(ValueError, match="2 environments for 0 ranks"):
        early_ranks.hand_over([{}, {}])
