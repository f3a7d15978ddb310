"""A parent with the imports already done, from which integration jobs fork their rank processes.

``python job.py CONFIG`` costs about 9 s of a 2-rank job's 10 on this project's machines: the launcher imports
torch, Lightning and transformers (~3.5 s), the rank it starts imports them again (~3.5 s) and each interpreter
takes ~1 s to tear down. This server imports once; for each job it forks one process per rank with the
environment an external launcher (torchrun) gives its ranks (``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_PORT``),
runs ``job.main`` in each and reports their exit statuses. A forked rank is an ordinary rank of an externally
launched job: the same Lightning environment, process groups, ledger and teardown; only the imports are skipped.

Protocol: one JSON request per line on stdin (``script``: ``job.py`` or ``fabric_job.py``; ``config``,
``devices``, ``env``, ``log``, ``timeout``), one JSON
reply per line on stdout (``codes``: per rank, a negative number for a signal; ``timed_out``). The ranks write
their stdout and stderr to ``log``. The server ends when its stdin closes (its test session ended) and takes
its ranks with it (``PR_SET_PDEATHSIG``, and a kill of their process groups).

Jobs that test the launcher, several hosts, memory or injected faults keep a process of their own
(``conftest.run_job`` decides).
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# what a job imports, loaded once here (this module must not run any torch operation: a forked child
# cannot use a thread pool its parent started)
import torch  # noqa: E402

from tests.integration import fabric_job, job  # noqa: E402

# each job script's entry point, called with the path of its configuration file
JOBS = {"job.py": job.main, "fabric_job.py": fabric_job.run}

PR_SET_PDEATHSIG = 1
# after one rank fails, how long the others get to notice and end by themselves (as they do under a launcher)
FAILED_RANK_GRACE_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(request: dict, rank: int, port: int) -> None:
    """In the forked child: become rank ``rank`` of the job, run it, and exit (never returns)."""
    code = 1
    try:
        os.setpgid(0, 0)
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.update(request["env"])
        # torch's threads as Lightning's launcher sets them for its ranks (the cores shared out, unless
        # OMP_NUM_THREADS says otherwise): torch was imported here before the job's environment could
        threads = request["env"].get("OMP_NUM_THREADS")
        if threads or request["devices"] > 1:
            torch.set_num_threads(int(threads or max(1, (os.cpu_count() or 1) // request["devices"])))
        if request["devices"] > 1:
            os.environ.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                LOCAL_RANK=str(rank),
                NODE_RANK="0",
                WORLD_SIZE=str(request["devices"]),
            )
        main = JOBS[request["script"]]
        sys.argv = [str(Path(job.__file__).with_name(request["script"])), request["config"]]
        try:
            main(request["config"])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()  # what the interpreter's exit would run: the job's and its libraries' hooks
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _status(raw: int) -> int:
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def _kill_groups(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(request: dict) -> dict:
    """Fork the job's ranks, wait for them (bounded by the request's timeout) and return their statuses."""
    port = _free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(request["devices"]):
        pid = os.fork()
        if pid == 0:
            _run_rank(request, rank, port)
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + request["timeout"]
    timed_out = False
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                done, raw = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = _status(raw)
                    if codes[pid] != 0:  # the others get a bounded time to notice, as under a launcher
                        deadline = min(deadline, time.monotonic() + FAILED_RANK_GRACE_S)
        if len(codes) < len(pids) and time.monotonic() > deadline:
            timed_out = not any(codes.values())
            running = [p for p in pids if p not in codes]
            if not timed_out:  # said in the job's log: a test can tell a job that ended by itself from this
                with open(request["log"], "a") as log:
                    ranks = [pids.index(p) for p in running]
                    log.write(
                        f"\njob server: rank(s) {ranks} still ran {FAILED_RANK_GRACE_S:.0f} s after a rank failed; killed\n"
                    )
            _kill_groups(running)
            for pid in pids:
                if pid not in codes:
                    codes[pid] = _status(os.waitpid(pid, 0)[1])
        time.sleep(0.02)
    _kill_groups(pids)  # anything a rank left behind in its group
    return {"codes": [codes[p] for p in pids], "timed_out": timed_out}


def serve() -> None:
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        reply = run(json.loads(line))
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    serve()
