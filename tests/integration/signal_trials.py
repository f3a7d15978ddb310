"""Random-moment signal trials on 2-rank jobs (tests/integration/reliability_job.py): start a job in a session of
its own, send a signal to one of its processes after a chosen delay, and follow every process of the session to
its end. Used by tests/integration/test_signal_trials.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from slidedp_lightning.runtime.host_os import process_children
from tests.conftest import environment_for_a_job

JOB = Path(__file__).with_name("reliability_job.py")


def _stat(path: str) -> list[str] | None:
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _exiting(pid: int) -> bool:
    """Some thread of ``pid`` has not ended yet. A killed process's main thread shows as a zombie while its other
    threads still run their exit, and the last of them unmaps the process's memory: until then it holds its pages."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    return any((st := _stat(f"/proc/{pid}/task/{tid}/stat")) is not None and st[0] not in "ZX" for tid in tids)


def session_pids(sid: int) -> list[int]:
    """The processes of session ``sid`` that have not ended: not zombies, or zombies with a thread still exiting."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat(f"/proc/{name}/stat")
        if fields is None or int(fields[3]) != sid:
            continue
        if fields[0] not in "ZX" or _exiting(int(name)):
            pids.append(int(name))
    return pids


@dataclass
class Trial:
    """One job and what happened to it."""

    code: int | None = None  # the launcher's exit status (negative: killed by that signal)
    output: str = ""
    signalled: int | None = None  # pid that got the signal (None: the job ended before the moment)
    phase: str = ""  # "setup" (no training step yet), "training", "save" (a checkpoint being written) or "ended"
    exit_s: float | None = None  # from the signal until every process of the session had ended
    leftover: list[int] = field(default_factory=list)  # processes still alive at the deadline (then killed)


def phase_of(out: Path) -> str:
    if any((out / "ckpt").glob(".*")):  # a save's hidden directory
        return "save"
    return "training" if (out / "step_rank0").exists() else "setup"


def run_trial(
    out: Path,
    delay: float,
    signum: int,
    target: str,
    env: dict[str, str] | None = None,
    deadline_s: float = 30.0,
    in_save: bool = False,
    **cfg,
) -> Trial:
    """Run one job; ``delay`` seconds after its start send ``signum`` to ``target`` ("launcher": the process the
    job started as, local rank 0; "rank1": the rank it launched, as soon as it exists after the moment);
    ``in_save``: the delay counts from the moment a checkpoint save has begun."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"out": str(out), **cfg}))
    base = environment_for_a_job()
    base.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", **(env or {}))
    log = open(out / "output.txt", "w")
    proc = subprocess.Popen(
        [sys.executable, str(JOB), str(out / "config.json")],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=base,
        start_new_session=True,
    )
    trial = Trial()
    if in_save:  # ``delay`` after a save has begun (its hidden directory appeared)
        while proc.poll() is None and not any((out / "ckpt").glob(".*")):
            time.sleep(0.005)
    time.sleep(delay)
    pid: int | None = proc.pid if target == "launcher" else None
    while pid is None and proc.poll() is None:
        found = [c for c in process_children(proc.pid) if _is_job(c)]  # not a helper the launcher started
        pid = found[0] if found else None
        if pid is None:
            time.sleep(0.01)
    trial.phase = phase_of(out) if proc.poll() is None else "ended"
    if pid is not None and proc.poll() is None:
        try:
            os.kill(pid, signum)
            trial.signalled = pid
        except ProcessLookupError:
            trial.phase = "ended"
    sent = time.monotonic()
    while session_pids(proc.pid) and time.monotonic() - sent < deadline_s:
        time.sleep(0.05)
    trial.leftover = session_pids(proc.pid)
    if trial.leftover:
        for p in trial.leftover:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    else:
        trial.exit_s = time.monotonic() - sent
    trial.code = proc.wait(timeout=30)
    while session_pids(proc.pid):  # killed ones: until the kernel has reaped them (their mappings go then)
        time.sleep(0.05)
    log.close()
    trial.output = (out / "output.txt").read_text(errors="replace")
    return trial


def baseline(
    out: Path, env: dict[str, str] | None = None, timeout: float = 300, **cfg
) -> tuple[int, float, float, str]:
    """Run the job without a signal: (exit status, seconds to its first training step, seconds in all, output)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"out": str(out), **cfg}))
    base = environment_for_a_job()
    base.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", **(env or {}))
    started = time.monotonic()
    first = None
    with open(out / "output.txt", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(JOB), str(out / "config.json")], stdout=log, stderr=subprocess.STDOUT, env=base
        )
        while proc.poll() is None and time.monotonic() - started < timeout:
            if first is None and (out / "step_rank0").exists():
                first = time.monotonic() - started
            time.sleep(0.02)
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
    total = time.monotonic() - started
    return code, first if first is not None else total, total, (out / "output.txt").read_text(errors="replace")


def _is_job(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return JOB.name.encode() in f.read()
    except OSError:
        return False
