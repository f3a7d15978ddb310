"""Ending a SlideDP job promptly: SIGTERM and SIGINT during a run, and the ranks a failed launching rank leaves
behind.

Lightning's SIGTERM handler broadcasts over the default process group inside the signal handler, in the middle of
whatever collective the rank was running; with the other ranks in a different collective (or one rank signalled
alone) both can wait for the whole process-group timeout. A SIGINT becomes Lightning's silent KeyboardInterrupt
shutdown on a rank other than 0. During a SlideDP run :class:`SignalGuard` takes both signals: the signalled rank
says so, forwards the signal to the ranks it launched (as Lightning's handler does) and stops at once with
:class:`SignalExit`, without a collective; the other ranks see it gone (dead pid, closed connections) and stop too.

With ``SLURMEnvironment(auto_requeue=True)`` Lightning saves an HPC checkpoint and runs ``scontrol requeue`` on
the requeue signal (SIGUSR1 by default), and only notes a SIGTERM (SLURM's warning before it kills a requeued
job), stopping the run at the next step. The guard keeps that behaviour without a collective in a handler: it
records either signal, and at the end of the step the ranks agree on what arrived and act together
(:mod:`slidedp_lightning.process.requeue`). A second SIGTERM stops the rank at once.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from slidedp_lightning.runtime.host_os import process_start_time, process_state

log = logging.getLogger(__name__)

GUARDED = (signal.SIGTERM, signal.SIGINT)
PR_SET_PDEATHSIG = 1
LAUNCHER_ENV = "SLIDEDP_LAUNCHER"  # "<pid>:<start time>" of the script launcher, inherited by the ranks it starts
REQUEUE, STOP = 1, 2  # requests recorded under SLURM auto-requeue, acted upon at the end of a step


class SignalExit(SystemExit):
    """This rank received a termination signal during a SlideDP run; exit status 128 + the signal's number."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


class SignalGuard:
    """SIGTERM handling for the length of one run (``install`` at the start of a stage, ``release`` at the end of
    teardown). ``describe()`` names this rank in the message; ``children()`` are the rank processes this one
    launched. While holding (teardown), a signal is only recorded, and raised once teardown is done."""

    def __init__(self, describe: Callable[[], str], children: Callable[[], list[subprocess.Popen]]) -> None:
        self._describe, self._children = describe, children
        self._previous: dict[int, Any] = {}
        self._state = "off"  # off | armed | holding (teardown, nothing raised yet) | stopping (raised)
        self._pending: int | None = None
        self._requeue_signal: int | None = None
        self._requests = 0  # REQUEUE | STOP, under SLURM auto-requeue
        self.save_and_stop = False  # either signal saves a checkpoint at the step's end, then stops (the job's)

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self, requeue_signal: int | None = None) -> None:
        """Take over the guarded signals (main thread only: elsewhere Python cannot set handlers);
        ``requeue_signal``: SLURM auto-requeue is on, that signal and SIGTERM are recorded for the step's end."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        self._state, self._pending, self._requests = "armed", None, 0
        self._requeue_signal = requeue_signal
        for signum in dict.fromkeys((*GUARDED, *([requeue_signal] if requeue_signal is not None else []))):
            self._previous[signum] = signal.signal(signum, self._handle)

    def take_requests(self) -> int:
        """The requests (``REQUEUE | STOP``) recorded since the last call."""
        requests, self._requests = self._requests, 0
        return requests

    def hold(self) -> None:
        """From now on (teardown) a signal is recorded, not raised: the run is ending anyway."""
        if self._state == "armed":
            self._state = "holding"

    def release(self) -> None:
        """Give the signals back to the handlers they had before :meth:`install`; raise :class:`SignalExit` if one
        arrived while holding."""
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            if signum in GUARDED and _is_lightnings(handler):
                # Lightning's handler only records the signal (its loop has ended) until its own teardown, next,
                # restores the handlers it found: in that window a signal ends this rank, saying so
                handler = self._after_run
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        state, pending, self._state, self._pending = self._state, self._pending, "off", None
        self._requeue_signal, self._requests, self.save_and_stop = None, 0, False
        if state == "holding" and pending is not None:
            raise SignalExit(pending)

    def _after_run(self, signum: int, frame: FrameType | None) -> None:
        log.error(
            "SlideDP: %s received %s after its run ended: stopping this rank now.",
            self._describe(),
            signal.Signals(signum).name,
        )
        for proc in self._children():
            if proc.poll() is None:
                proc.send_signal(signum)
        raise SignalExit(signum)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == self._requeue_signal:
            if self._state == "armed":
                self._requests |= REQUEUE
                log.warning(
                    "SlideDP: %s received %s%s at the end of this step.",
                    self._describe(),
                    signal.Signals(signum).name,
                    ": saving a checkpoint and stopping"
                    if self.save_and_stop
                    else " (SLURM auto-requeue): saving a checkpoint and requeueing the job",
                )
            return  # in teardown there is no step left to save
        if signum == signal.SIGTERM and self._requeue_signal is not None and self._state == "armed":
            if not self._requests & STOP:  # the first SIGTERM is SLURM's warning: stop at the end of the step
                if not self.save_and_stop:  # (saving, the ranks agree at the step's end: a forwarded signal would
                    for proc in self._children():  # be a second one for a rank signalled with its process group)
                        if proc.poll() is None:
                            proc.send_signal(signum)
                self._requests |= STOP
                log.warning(
                    "SlideDP: %s received SIGTERM%s: %s at the end of this step; a second SIGTERM stops it at once.",
                    self._describe(),
                    "" if self.save_and_stop else " (SLURM auto-requeue)",
                    "saving a checkpoint and stopping" if self.save_and_stop else "stopping",
                )
                return
        if self._state in ("stopping", "off") or self._pending is not None:
            return  # stopping already: a second signal must not interrupt the teardown the first one started
        for proc in self._children():
            if proc.poll() is None:
                proc.send_signal(signum)
        if self._state == "holding":
            self._pending = signum
            return
        self._state = "stopping"
        log.error(
            "SlideDP: %s received %s: stopping this rank now, without a collective (the other ranks stop when they "
            "see it gone).",
            self._describe(),
            signal.Signals(signum).name,
        )
        raise SignalExit(signum)


def name_launcher() -> None:
    """Record this process (about to start the other ranks) in the environment they inherit."""
    os.environ[LAUNCHER_ENV] = f"{os.getpid()}:{process_start_time(os.getpid())}"


def _stopped_outside_run(signum: int, frame: FrameType | None) -> None:
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
    log.error(
        "SlideDP: rank %s (pid %d) received %s outside the training loop (setup: model, ledger, checkpoint; or "
        "between runs): stopping now, nothing is saved.",
        rank,
        os.getpid(),
        signal.Signals(signum).name,
    )
    raise SignalExit(signum)


def say_why_when_stopped() -> None:
    """Until Lightning and :class:`SignalGuard` take SIGTERM over (at the start of training), a SIGTERM ends the
    process with a line saying so (exit status 143) instead of silently: only where nothing else handles it."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _stopped_outside_run)


def end_with_launcher(launched: bool) -> bool:
    """A rank process started by a launcher (Lightning's script launcher, torchrun, srun) gets SIGTERM when that
    launcher dies (Linux ``PR_SET_PDEATHSIG``): an orphaned rank would otherwise wait for a dead rank 0 until
    the rendezvous or process-group timeout. A rank whose script launcher (:func:`name_launcher`) died before
    this point stops at once. Returns whether the signal was set. Called as a run's environment is set up, it
    also has a SIGTERM during setup say why the rank stopped (:func:`say_why_when_stopped`)."""
    say_why_when_stopped()
    if not launched or not sys.platform.startswith("linux"):
        return False
    armed = _set_parent_death_signal(signal.SIGTERM)
    pid, _, started = os.environ.get(LAUNCHER_ENV, "").partition(":")
    gone = pid.isdigit() and (process_start_time(int(pid)) != started or process_state(int(pid)) in ("Z", "X"))
    if gone and int(pid) != os.getppid():  # (a zombie has exited: its parent has not collected it yet)
        log.error("SlideDP: the launcher of this rank (local rank 0, pid %s) has died: stopping this rank.", pid)
        raise SignalExit(signal.SIGTERM)
    return armed


def _set_parent_death_signal(signum: int) -> bool:
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@contextlib.contextmanager
def killed_with_launcher(armed: bool) -> Iterator[None]:
    """Around torch's rendezvous: its store client retries a lost connection in C++ for the whole process-group
    timeout (twice), where no Python SIGTERM handler can run, so a rank whose launcher died there would stay for
    minutes. Inside, the launcher's death SIGKILLs this rank (nothing of the run exists yet: no group, no ledger);
    after it, SIGTERM again. ``armed``: what :func:`end_with_launcher` returned."""
    if not armed:
        yield
        return
    _set_parent_death_signal(signal.SIGKILL)
    try:
        yield
    finally:
        _set_parent_death_signal(signal.SIGTERM)


class LaunchedAtExit:
    """What the script launcher's local rank 0 does with the rank processes it started when it exits (one hook per
    process, the last teardown's outcome counts). After a failed run it SIGKILLs (and reaps) the stopped ones
    (SIGSTOP or a job-control stop): they cannot notice that the job ended, and would be left behind forever;
    running ones notice this process's exit themselves (and print why). After a run that ended well it waits (up to
    ``wait_s``) for them to end, since they end with it (``PR_SET_PDEATHSIG``), and names any that did not end
    well, e.g. one ended by a signal after its run; this process then exits with status 1, as a launcher does when
    a rank it started fails, not 0."""

    def __init__(self, at_exit: bool = True) -> None:
        self.procs: list[subprocess.Popen] = []
        self.failed, self.wait_s, self._register = False, 0.0, at_exit

    def update(self, procs: list[subprocess.Popen], failed: bool, wait_s: float) -> None:
        if not procs:
            return
        self.procs, self.failed, self.wait_s = list(procs), failed, wait_s
        if self._register:  # once, at the first run with launched ranks
            atexit.register(self._at_exit)
            self._register = False

    def _at_exit(self) -> None:
        if self.settle():
            for handler in logging.getLogger().handlers:
                handler.flush()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # an exit handler cannot change the status otherwise

    def settle(self) -> bool:
        """Do what the class describes; returns whether a rank ended badly after a run that ended well."""
        if self.failed:
            _kill_stopped(self.procs)
            return False
        deadline, told = time.monotonic() + self.wait_s, time.monotonic() + 10.0
        for proc in self.procs:
            while proc.poll() is None and process_state(proc.pid) not in ("T", "t") and time.monotonic() < deadline:
                if time.monotonic() > told:
                    log.warning(
                        "SlideDP: waiting (up to %.0f s) for the rank process %d to end.", self.wait_s, proc.pid
                    )
                    told = deadline
                time.sleep(0.02)
        said = ended_children([p for p in self.procs if p.poll() not in (None, 0)])
        if said:
            log.error("SlideDP: after the run, %s: this job failed.", said)
        running = [p.pid for p in self.procs if p.poll() is None]
        if running:
            log.warning("SlideDP: the rank process(es) %s have not ended; they end with this one.", running)
        return bool(said)


LAUNCHED_AT_EXIT = LaunchedAtExit()


def _kill_stopped(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is not None or process_state(proc.pid) not in ("T", "t"):
            continue
        log.error("SlideDP: the rank process %d is stopped; killing it, since the job has failed.", proc.pid)
        proc.kill()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _is_lightnings(handler: Any) -> bool:
    """Whether ``handler`` is the one Lightning's signal connector installs for the length of a trainer call."""
    from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose

    return isinstance(handler, _HandlersCompose)


def ended_children(procs: list[subprocess.Popen]) -> str:
    """How the processes of ``procs`` that have ended did so, e.g. "the rank process 4242 was ended by SIGTERM";
    empty when all run."""
    out = []
    for proc in procs:
        code = proc.poll()
        if code is None:
            continue
        how = f"was ended by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        out.append(f"the rank process {proc.pid} {how}")
    return "; ".join(out)
