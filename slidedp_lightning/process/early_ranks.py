"""A script-launched job's other local ranks, started while the launching process still imports.

Lightning's script launcher starts local ranks 1..n-1 as new interpreters running the same command once local rank 0
reaches ``trainer.fit`` (or ``fabric.launch()``). Each then imports torch, Lightning and transformers (about 5 s on a
2-core host) while rank 0, which has done the same already, waits for them in the rendezvous: every job pays the
imports twice, one after the other. :func:`begin`, called at the top of the command before anything heavy is
imported, starts those interpreters at once with the same command; each imports what the job needs and then waits
(:func:`wait_for_launch`) until the launcher reaches the point where it would have started it, and hands it the
environment it would have started it with (:func:`hand_over`, from the launcher's ``_call_children_scripts``). The
processes, their command and their environment are the launcher's; only the imports overlap.

A rank started early dies with the process that started it (Linux ``PR_SET_PDEATHSIG``, SIGKILL: nothing of the run
exists yet), and ends quietly if that process ends without handing it over (a refused plan, an error before the
launch): it sees the end of its pipe. Plain Python (the standard library only), read by file by the command line
before the library is imported.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence

# in a rank started early: "<fd of its pipe>:<pid of the process that started it>"
ENV = "SLIDEDP_EARLY_RANK"
# set by another launcher (torchrun, srun, mpirun, LSF, a cluster environment): it starts the ranks, not this process
_LAUNCHED_ELSEWHERE = (
    "LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE", "LSB_JOBID", "JSM_NAMESPACE_SIZE",
)  # fmt: skip
_PR_SET_PDEATHSIG = 1


class _Started:
    """The ranks this process started early: their processes and the write ends of their pipes, in local rank
    order (1, 2, ...), and the command they run."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.pipes: list[int] = []
        self.command: list[str] = []

    def close(self) -> None:
        for fd in self.pipes:
            os.close(fd)
        self.procs, self.pipes, self.command = [], [], []


_started = _Started()


def script_command() -> list[str]:
    """The command Lightning's script launcher runs for the other ranks (``_basic_subprocess_cmd``): this
    interpreter and this script (or ``-m`` module), with this process's arguments."""
    import __main__

    spec = getattr(__main__, "__spec__", None)
    if spec is None:
        return [sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]]
    return [sys.executable, "-m", spec.name, *sys.argv[1:]]


def launching_here(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process would be the one to start the job's other local ranks: no other launcher started it."""
    env = os.environ if env is None else env
    return not any(name in env for name in _LAUNCHED_ELSEWHERE)


def begin(local_ranks: int) -> None:
    """At the top of a script-launched job's command, before torch, Lightning or transformers are imported.

    In the launching process of a job with ``local_ranks`` > 1 ranks on this host: start local ranks
    1..``local_ranks``-1 now (:func:`script_command`, this environment plus ``LOCAL_RANK``). In a rank started so:
    have it die with the process that started it. Elsewhere nothing."""
    if ENV in os.environ:
        _die_with_starter()
        return
    if local_ranks < 2 or _started.procs or not launching_here():
        return
    command = script_command()
    for local_rank in range(1, local_ranks):
        read, write = os.pipe()
        env = {**os.environ, "LOCAL_RANK": str(local_rank), ENV: f"{read}:{os.getpid()}"}
        try:
            proc = subprocess.Popen(command, env=env, pass_fds=(read,))
        finally:
            os.close(read)
        _started.procs.append(proc)
        _started.pipes.append(write)
    _started.command = command


def _die_with_starter() -> None:
    """``PR_SET_PDEATHSIG`` as :func:`slidedp_lightning.process.signals.end_with_launcher` sets it, which cannot be
    imported here (its package imports Lightning), then the check that the starter had not already ended."""
    _, _, starter = os.environ[ENV].partition(":")
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if starter.isdigit() and os.getppid() != int(starter):  # it ended before the signal was set
        os._exit(0)


def started(command: Sequence[str], count: int) -> bool:
    """Whether this process started ``count`` ranks early that run ``command``: the launcher hands them over
    instead of starting new ones."""
    return bool(_started.procs) and len(_started.procs) == count and list(command) == _started.command


def hand_over(envs: Sequence[Mapping[str, str]]) -> list[subprocess.Popen]:
    """The launcher's side: give the ranks started early their environments (``envs``, in local rank order, as the
    launcher would have started them with) and return their processes, now the launcher's. A rank that has already
    ended is returned as it is: the launcher's watch over its ranks reports it."""
    if len(envs) != len(_started.procs):
        raise ValueError(f"{len(envs)} environments for {len(_started.procs)} ranks started early")
    procs, pipes = _started.procs, _started.pipes
    _started.pipes = []
    _started.close()
    for fd, env in zip(pipes, envs, strict=True):
        try:
            with open(fd, "wb") as pipe:  # closed even where the write fails
                pipe.write(json.dumps(dict(env)).encode() + b"\n")
        except BrokenPipeError:
            pass
    return procs


def discard() -> None:
    """The launcher starts its ranks itself (another command, another count): the ranks started early see the end
    of their pipes and exit."""
    _started.close()


def wait_for_launch() -> None:
    """In a rank started early (nothing elsewhere), once its imports are done: wait for the launcher to hand it
    over and take the environment it gives; exit quietly (status 0) if the launcher ends without doing so."""
    value = os.environ.get(ENV)
    if value is None:
        return
    fd = int(value.partition(":")[0])
    data = b""
    try:
        with os.fdopen(fd, "rb") as pipe:
            data = pipe.readline()
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the launcher says why it stops
        os._exit(130)
    if not data:
        os._exit(0)
    env = json.loads(data)
    os.environ.clear()
    os.environ.update(env)


__all__ = ["ENV", "begin", "discard", "hand_over", "launching_here", "script_command", "started", "wait_for_launch"]
