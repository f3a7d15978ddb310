"""slidedp_lightning.requeue and the guard's SLURM auto-requeue mode, in this process (the 2-rank jobs with real
signals and a fake scontrol are in tests/integration/test_requeue.py)."""

from __future__ import annotations

import os
import signal

import pytest

from slidedp_lightning.requeue import slurm_job_id
from slidedp_lightning.signals import REQUEUE, STOP, SignalExit, SignalGuard


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
