"""No job process outlives the benchmark: killed with its parent, its group ended, killed on interrupt."""

from __future__ import annotations

import _thread
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.baselines import lifetime, runner
from bench.baselines.runner import run_job
from bench.configs import plan, scale

REPO = Path(__file__).resolve().parents[2]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def wait_gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_job_process_dies_when_its_parent_is_killed(tmp_path):
    """The parent starts a 'job' in its own session (as the runner does) and is then SIGKILLed: no cleanup runs in
    it, yet the job goes too."""
    pidfile = tmp_path / "job.pid"
    job = (
        f"import sys, time; sys.path.insert(0, {str(REPO)!r})\n"
        "from bench.baselines.lifetime import die_with_parent\n"
        "assert die_with_parent()\n"
        f"open({str(pidfile)!r}, 'w').write(str(__import__('os').getpid()))\n"
        "time.sleep(120)\n"
    )
    parent = (
        "import os, subprocess, sys, time\n"
        f"env = {{**os.environ, {lifetime.PARENT_ENV!r}: str(os.getpid())}}\n"
        f"subprocess.Popen([sys.executable, '-c', {job!r}], env=env, start_new_session=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent])
    deadline = time.monotonic() + 60
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, "the job never started"
        time.sleep(0.05)
    job_pid = int(pidfile.read_text())
    assert alive(job_pid)
    proc.kill()
    proc.wait()
    assert wait_gone(job_pid), "the job outlived its parent"


def test_a_process_whose_parent_is_already_gone_exits_at_once():
    env = {**os.environ, lifetime.PARENT_ENV: "1" if os.getppid() != 1 else "2"}  # not our parent
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); from bench.baselines.lifetime import die_with_parent; die_with_parent(); print('ran on')"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "ran on" not in out.stdout


def test_end_group_kills_what_the_leader_left_behind():
    proc = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; exit 0"], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    orphan = int(proc.stdout.readline())
    proc.wait()
    lifetime.track(proc.pid)
    assert alive(orphan)
    assert lifetime.end_group(proc.pid, grace_s=0.2) is True
    assert wait_gone(orphan) and proc.pid not in lifetime.tracked()


# A Ctrl-C reaches run_job within milliseconds: this long after it, the interrupt is taken as lost and the fake
# job is ended, so that run_job returns and the test fails now instead of sleeping out the job.
LOST_S = 8.0


def test_an_interrupted_job_is_killed_with_its_children(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM, turned into it) while run_job waits: the job's whole process group is killed."""
    children = tmp_path / "child.pid"
    fake_job = (
        "import subprocess, time\n"
        f"p = subprocess.Popen(['sleep', '120']); open({str(children)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(120)\n"
    )
    real_popen = subprocess.Popen
    started: list[subprocess.Popen] = []

    def popen(args, **kw):
        proc = real_popen([sys.executable, "-c", fake_job], **kw)
        started.append(proc)
        return proc

    monkeypatch.setattr(runner.subprocess, "Popen", popen)
    spec = next(r.spec for j in plan(scale("cpu"), tmp_path, init=lambda s, q, r: r / "x.pt") for r in j.runs)
    # the simulated Ctrl-C is Python's SIGINT handler run in the main thread: without a handler (SIGINT ignored,
    # as a shell without job control starts a background command) it is dropped; tests/conftest.py installs one
    handler = signal.getsignal(signal.SIGINT)
    assert handler is signal.default_int_handler, f"SIGINT is not handled by Python here ({handler!r})"
    returned, lost = threading.Event(), threading.Event()

    def interrupt_when_started():
        deadline = time.monotonic() + 60
        while not (children.exists() and children.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        _thread.interrupt_main()
        if not returned.wait(LOST_S) and started:
            lost.set()
            os.killpg(started[0].pid, signal.SIGKILL)

    threading.Thread(target=interrupt_when_started, daemon=True).start()
    try:
        run_job([("systems/x/ddp", spec)], tmp_path / "job", preflight=False)
    except KeyboardInterrupt:
        pass
    else:
        pytest.fail(
            f"run_job returned: the interrupt never reached it (ended the fake job after {LOST_S:.0f} s: {lost.is_set()})"
        )
    finally:
        returned.set()
    child = int(children.read_text())
    assert wait_gone(started[0].pid) and wait_gone(child), "a process of the interrupted job is still running"
    assert lifetime.tracked() == []
