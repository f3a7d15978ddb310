"""2-rank reliability jobs (tests/integration/reliability_job.py): no collective thread survives a run, a second run
in the same processes starts cleanly, a stopped rank is named and cleaned up, and a signal to one rank ends the job
within seconds."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import environment_for_a_job

pytestmark = pytest.mark.slow  # multi-process jobs

JOB = Path(__file__).with_name("reliability_job.py")
COLLECTIVE_THREADS = ("gloo", "tcpstore", "nccl")
EXIT_ABORT = "terminate called"


def run(tmp: Path, timeout: float = 240, **cfg) -> tuple[int, str, float]:
    """Run one job; returns (exit status, output of every rank, seconds)."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps({"out": str(tmp), **cfg}))
    env = environment_for_a_job()
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(JOB), str(tmp / "config.json")], capture_output=True, text=True, timeout=timeout, env=env
    )
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - started


def collective(names: list[str]) -> list[str]:
    return [n for n in names if any(key in n for key in COLLECTIVE_THREADS)]


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.integration
@pytest.mark.parametrize(
    "name, strategy, refit",
    [("sharded", {"param_route": "sharded"}, "fit"), ("host_reduce", {"grad_route": "host_reduce"}, "validate")],
)
def test_no_collective_thread_survives_a_run_and_a_second_run_starts_cleanly(tmp_path, name, strategy, refit):
    """The runtime's own groups (a second shard group for the sharded route), the default group and rank 0's
    TCPStore server are gone after every run; the second run's ranks find a fresh store; the job exits 0 with no
    abort at interpreter exit, after a collective right before teardown."""
    code, output, _ = run(tmp_path / name, strategy=strategy, refit=refit, last_collective=True)
    assert code == 0 and EXIT_ABORT not in output, output[-3000:]
    for rank in (0, 1):
        threads = json.loads((tmp_path / name / f"threads_rank{rank}.json").read_text())
        assert collective(threads["before"]) == []
        assert collective(threads["after_fit"]) == [], (rank, threads)
        assert collective(threads["after_refit"]) == [], (rank, threads)
        assert (tmp_path / name / f"done_rank{rank}").exists()


@pytest.mark.integration
def test_a_stopped_rank_is_named_by_the_others_and_killed_when_the_job_fails(tmp_path):
    """Rank 1 SIGSTOPs itself: rank 0 times out naming rank 1's pid and that it is stopped, and the launcher
    (rank 0) kills the stopped rank at its exit instead of leaving it behind."""
    # a process-group timeout of 12 s: above a loaded machine's rendezvous (rank 1 imports for 3-8 s)
    code, output, elapsed = run(tmp_path, timeout=200, stop_rank=1, stop_at_step=1, pg_timeout=12, steps=4)
    pid = int((tmp_path / "pid_rank1").read_text())
    assert code != 0
    assert f"rank 1 (pid {pid}) of this host is stopped" in output, output[-3000:]
    assert elapsed < 12 + 60, f"the job took {elapsed:.0f} s to stop (process-group timeout 12 s)"
    deadline = time.monotonic() + 10
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(pid), f"the stopped rank (pid {pid}) was left behind"


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_to_one_rank_ends_the_job_within_seconds(tmp_path, rank, signame):
    """A signal to one rank of a 2-rank job (the process-group timeout is 120 s): every rank has exited within a
    minute, the signalled rank says so, and none is left behind."""
    code, output, elapsed = run(
        tmp_path, timeout=200, signal_rank=rank, signal_at_step=2, signal=signame, pg_timeout=120, steps=6
    )
    pids = [int((tmp_path / f"pid_rank{r}").read_text()) for r in (0, 1)]
    assert code != 0
    assert elapsed < 60, f"the job took {elapsed:.0f} s to stop (process-group timeout 120 s):\n{output[-3000:]}"
    assert f"rank {rank} (pid {pids[rank]}) received {signame}" in output, output[-3000:]
    deadline = time.monotonic() + 10
    while not all(gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(p) for p in pids), "a rank was left behind"
    assert not (tmp_path / f"done_rank{1 - rank}").exists()
