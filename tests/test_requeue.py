"""slidedp_lightning.process.requeue and the guard's SLURM auto-requeue mode, in this process (the 2-rank jobs with real
signals and a fake scontrol are in tests/integration/test_requeue.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from slidedp_lightning.process.requeue import slurm_job_id
from slidedp_lightning.process.signals import REQUEUE, STOP, SignalExit, SignalGuard


class Child:
    """A launched rank that records the signals forwarded to it."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    def poll(self) -> None:
        return None

    def send_signal(self, signum: int) -> None:
        self.sent.append(signum)


def test_under_auto_requeue_the_signals_are_recorded_for_the_end_of_the_step() -> None:
    child = Child()
    guard = SignalGuard(lambda: "rank 0", lambda: [child])  # type: ignore[list-item]
    before = signal.getsignal(signal.SIGUSR1)
    guard.install(requeue_signal=signal.SIGUSR1)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert guard.take_requests() == REQUEUE and guard.take_requests() == 0
        assert child.sent == [], "the requeue signal is each rank's own (the step's end agrees over all)"
        os.kill(os.getpid(), signal.SIGTERM)  # SLURM's warning: bypassed, recorded, forwarded
        os.kill(os.getpid(), signal.SIGUSR1)
        assert guard.take_requests() == REQUEUE | STOP and child.sent == [signal.SIGTERM]
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(SignalExit) as info:
            os.kill(os.getpid(), signal.SIGTERM)
        assert info.value.code == 128 + signal.SIGTERM
    finally:
        guard.release()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_without_auto_requeue_sigterm_stops_at_once_and_sigusr1_is_not_taken() -> None:
    guard = SignalGuard(lambda: "rank 0", lambda: [])
    before = signal.getsignal(signal.SIGUSR1)
    guard.install()
    try:
        assert signal.getsignal(signal.SIGUSR1) == before
        with pytest.raises(SignalExit):
            os.kill(os.getpid(), signal.SIGTERM)
        assert guard.take_requests() == 0
    finally:
        guard.release()


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"SLURM_JOB_ID": "123"}, "123"),
        ({"SLURM_JOB_ID": "9", "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3"}, "77_3"),
    ],
)
def test_the_job_id_scontrol_requeues(monkeypatch, env, expected) -> None:
    for key in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert slurm_job_id() == expected


def test_a_job_id_that_is_not_one_is_refused(monkeypatch) -> None:
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "1; rm -rf /")
    with pytest.raises(RuntimeError, match="SLURM_JOB_ID"):
        slurm_job_id()


CHILD = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("signals", sys.argv[1])  # stdlib only: no package import
signals = importlib.util.module_from_spec(spec)
spec.loader.exec_module(signals)
print(signals.end_with_launcher(sys.argv[2] == "1"), flush=True)
time.sleep(120)
"""
PARENT = """
import subprocess, sys
args = [sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]]
child = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
print(child.pid, child.stdout.readline().strip(), flush=True)
"""


def orphan(child: str, launched: bool, wait_s: float) -> tuple[str, bool]:
    """Start ``child`` (its argv: this project's signals.py, "1" if launched) from a parent that exits once the child
    printed a line; wait up to ``wait_s`` for the orphaned child to end. Returns (its line, whether it still ran)."""
    from slidedp_lightning.process import signals

    out = subprocess.run(
        [sys.executable, "-c", PARENT, child, signals.__file__, "1" if launched else "0"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.split()
    pid, line = int(out[0]), out[1]
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and signals.process_state(pid) not in (None, "Z"):
        time.sleep(0.05)
    alive = signals.process_state(pid) not in (None, "Z")
    if alive:
        os.kill(pid, signal.SIGKILL)
    return line, alive


@pytest.mark.slow
@pytest.mark.parametrize("launched", [True, False])
def test_a_launched_rank_ends_when_its_launcher_dies(launched: bool) -> None:
    # an armed rank gets its signal as the launcher exits and ends in well under a second: the one not armed has
    # shown it does not end with it after 3 s
    armed, alive = orphan(CHILD, launched, 10 if launched else 3)
    assert armed == str(launched)
    assert alive != launched, "the orphaned rank must end with its launcher (and only a launched one)"


CHILD_IN_RENDEZVOUS = """
import importlib.util, socket, sys
from datetime import timedelta
import torch.distributed as dist
spec = importlib.util.spec_from_file_location("signals", sys.argv[1])
signals = importlib.util.module_from_spec(spec)
spec.loader.exec_module(signals)
armed = signals.end_with_launcher(sys.argv[2] == "1")
with socket.socket() as s:  # a port nobody listens on: the store client retries its connect in C++
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
print(armed, flush=True)
with signals.killed_with_launcher(armed):
    dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60))
"""


@pytest.mark.slow
def test_a_rank_in_the_rendezvous_ends_when_its_launcher_dies() -> None:
    """torch's store client retries a refused connect in C++ for the whole timeout, where the rank's Python SIGTERM
    handler cannot run: there the launcher's death must kill the rank outright."""
    armed, alive = orphan(CHILD_IN_RENDEZVOUS, True, 10)
    assert armed == "True"
    assert not alive, "a rank in the rendezvous outlived its launcher by 10 s"


def test_a_rank_whose_script_launcher_died_before_it_could_ask_to_end_with_it_stops(monkeypatch) -> None:
    from slidedp_lightning.process import signals

    monkeypatch.setenv(signals.LAUNCHER_ENV, f"{2**22 + 11}:123")  # no such process
    with pytest.raises(SignalExit):
        signals.end_with_launcher(True)
    zombie = subprocess.Popen(["true"])
    while signals.process_state(zombie.pid) != "Z":  # exited, not collected yet
        time.sleep(0.01)
    monkeypatch.setenv(signals.LAUNCHER_ENV, f"{zombie.pid}:{signals.process_start_time(zombie.pid)}")
    with pytest.raises(SignalExit):
        signals.end_with_launcher(True)
    zombie.wait()
    signals.name_launcher()  # this process: alive (not the parent, but not gone either)
    assert os.environ[signals.LAUNCHER_ENV].startswith(f"{os.getpid()}:")
    assert signals.end_with_launcher(True)
    assert not signals.end_with_launcher(False)
