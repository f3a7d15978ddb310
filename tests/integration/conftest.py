"""Runs Lightning jobs (tests/integration/job.py) in subprocesses with a timeout, so a hang is a failure."""

from __future__ import annotations

import atexit
import glob
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import environment_for_a_job
from tests.integration.job_config import JobConfig, check_keys

JOB = Path(__file__).with_name("job.py")
SERVER = Path(__file__).with_name("job_server.py")
# what a process aborting at interpreter exit prints (a collective backend's thread destroyed while joinable); the
# strategy destroys its process groups at teardown, so a job showing it fails like any other non-zero exit
EXIT_ABORT = "terminate called without an active exception"


@dataclass
class JobResult:
    returncode: int
    output: str
    out: Path
    ranks: int = 1

    def losses(self, rank: int) -> list[float]:
        return json.loads((self.out / f"losses_rank{rank}.json").read_text())

    def threads(self, rank: int) -> int:
        """torch's thread count on the rank's training thread, as its last training step saw it."""
        return json.loads((self.out / f"threads_rank{rank}.json").read_text())

    def state(self) -> dict[str, torch.Tensor]:
        return torch.load(self.out / "final_state.pt")

    def initial(self, rank: int) -> dict[str, str] | None:
        """The hash of each parameter as the job built it (None where it was built on the meta device)."""
        path = self.out / f"init_rank{rank}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def ledger(self, rank: int) -> dict:
        return json.loads((self.out / f"ledger_rank{rank}.json").read_text())


def shm_files() -> set[str]:
    return set(glob.glob("/dev/shm/slidedp-*"))


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment for a job: without the launch and seed variables an in-process Lightning fit may
    have left (tests/conftest.py), so the job starts its own ranks with its own seed."""
    return {**environment_for_a_job(), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **extra}


class JobServer:
    """The client of ``job_server.py``: started on first use, one per test session, ended with it."""

    _proc: subprocess.Popen | None = None

    @classmethod
    def run(
        cls, config: Path, devices: int, env: dict[str, str], timeout: float, script: str = "job.py"
    ) -> tuple[int, str]:
        """Run ``script``'s job of configuration file ``config``: (the first non-zero rank status or 0, its output);
        raises ``subprocess.TimeoutExpired`` as ``subprocess.run`` does."""
        proc = cls._start()
        log = config.with_name("job.log")
        log.write_text("")
        request = {"script": script, "config": str(config), "devices": devices, "env": env, "log": str(log)}
        request["timeout"] = timeout
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if not line:
            cls._proc = None
            raise RuntimeError(f"the job server ended (status {proc.wait()}) while running {config}")
        reply = json.loads(line)
        output = log.read_text()
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired([script, str(config)], timeout, output=output)
        return next((c for c in reply["codes"] if c != 0), 0), output

    @classmethod
    def _start(cls) -> subprocess.Popen:
        if cls._proc is None or cls._proc.poll() is not None:
            proc = subprocess.Popen(
                [sys.executable, str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=clean_env()
            )
            assert proc.stdout is not None
            if "ready" not in proc.stdout.readline():
                raise RuntimeError(f"the job server did not start (status {proc.wait()})")
            cls._proc = proc
            atexit.register(cls._stop)
        return cls._proc

    @classmethod
    def _stop(cls) -> None:
        if cls._proc is not None and cls._proc.stdin is not None:
            cls._proc.stdin.close()
            try:
                cls._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                cls._proc.kill()
        cls._proc = None


def forked(config: JobConfig, env: dict[str, str]) -> bool:
    """Whether a job's ranks can be forked from the job server: not when it tests the launcher (several hosts,
    injected faults), measures memory, uses a GPU or sets an environment variable read at import time."""
    return (
        config.num_nodes == 1
        and config.accelerator == "cpu"
        and not config.record_memory
        and config.raise_at_step < 0
        and config.kill_at_step < 0
        and config.kill_in_save is None
        and all(k.startswith("SLIDEDP_") for k in env)
    )


def run_job(
    tmp: Path, timeout: float = 240, env: dict[str, str] | None = None, launch: str = "auto", **cfg
) -> JobResult:
    """Run one job (``cfg``: JobConfig fields; ``out`` defaults to ``tmp``); an unknown key raises before it starts.
    ``launch="script"`` starts it as ``python job.py`` (Lightning's script launcher starts the other ranks);
    ``"auto"`` forks its ranks from the job server where :func:`forked` allows; ``"fork"`` forks them for a job
    with an injected fault too (its ranks are then launched as torchrun launches them: no rank watches the others)."""
    config = JobConfig.from_dict({"out": str(tmp), **cfg})
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(config.to_json())
    if launch == "fork" and (config.num_nodes != 1 or config.accelerator != "cpu" or config.record_memory):
        raise ValueError("launch='fork' runs single-host CPU jobs that measure no memory")
    if launch == "fork" or (launch == "auto" and forked(config, env or {})):
        code, output = JobServer.run(tmp / "config.json", config.devices, env or {}, timeout)
        return JobResult(code, output, tmp, config.devices)
    proc = subprocess.run(
        [sys.executable, str(JOB), str(tmp / "config.json")],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env(**(env or {})),
    )
    output = proc.stdout + proc.stderr
    return JobResult(proc.returncode, output, tmp, config.devices)


def variant_result(job: JobResult, name: str) -> JobResult:
    """One variant's outputs inside a variants job, as a job result of its own (a variant that failed wrote its
    traceback to ``error.txt`` and the job ran the others on)."""
    out = job.out / name
    error = out / "error.txt"
    ok = not error.exists() and (out / "final_state.pt").exists()
    return JobResult(0 if ok else 1, error.read_text() if error.exists() else job.output, out, job.ranks)


def variants_job(job_runner, name: str, variants: dict[str, dict], timeout: float = 900, **cfg) -> JobResult:
    """One job (cached by ``name``) fitting every variant in turn in the same processes; a failed variant writes its
    traceback and the others still run. Read each one with :func:`variant_result`."""
    return job_runner(name, variants=variants, keep_going=True, timeout=timeout, **cfg)


def run_nodes(tmp: Path, nodes: int, timeout: float = 300, **cfg) -> JobResult:
    """One job over ``nodes`` "hosts" on this machine: a launcher per node (its own NODE_RANK, so its own ledger),
    ``cfg["devices"]`` ranks each, one rendezvous."""
    import socket

    config = JobConfig.from_dict({"out": str(tmp), **cfg, "num_nodes": nodes})
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(config.to_json())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    procs = [
        subprocess.Popen(
            [sys.executable, str(JOB), str(tmp / "config.json")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**base, "NODE_RANK": str(n)},
        )
        for n in range(nodes)
    ]
    outputs, codes = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outputs.append(out)
        codes.append(p.returncode)
    output = "\n".join(f"--- node {n} ---\n{o}" for n, o in enumerate(outputs))
    code = next((c for c in codes if c != 0), 0)
    return JobResult(code, output, tmp, nodes * config.devices)


@pytest.fixture(scope="session")
def job_runner(tmp_path_factory):
    """``job_runner(name, **cfg)``: run one job once per session (results are cached by name); the keys of
    ``cfg`` are checked on every call, so a misspelt one fails even when the name's result is cached."""
    cache: dict[str, JobResult] = {}

    def run(
        name: str, env: dict[str, str] | None = None, timeout: float = 240, launch: str = "auto", **cfg
    ) -> JobResult:
        check_keys(cfg)
        if name not in cache:
            cache[name] = run_job(tmp_path_factory.mktemp(name), timeout=timeout, env=env, launch=launch, **cfg)
        return cache[name]

    return run


@pytest.fixture(scope="session")
def trace_dir(tmp_path_factory) -> str:
    """Where the traced case of the equivalence suite writes its lane trace (one folder per session)."""
    return str(tmp_path_factory.mktemp("trace"))


STEPS = 20


BATCH = 4


RTOL = 1e-5


def assert_ok(result) -> None:
    assert result.returncode == 0, result.output[-4000:]


def assert_bit_identical(base, got, what: str) -> None:
    """Two 2-rank jobs give the same losses on every rank and the same final weights, bit for bit."""
    for rank in range(2):
        assert got.losses(rank) == base.losses(rank), f"rank {rank}: losses differ {what}"
    a, b = base.state(), got.state()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs {what}"


def compare_runs(ref, got, ranks: int) -> None:
    for r in range(ranks):
        ia, ib = ref.initial(r), got.initial(r)
        if ia is not None and ib is not None:
            apart = sorted(k for k in ia.keys() | ib.keys() if ia.get(k) != ib.get(k))
            assert not apart, f"rank {r}: the runs started from different weights: {', '.join(apart[:4])}"
        a, b = ref.losses(r), got.losses(r)
        assert len(a) == len(b) == STEPS
        worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
        assert worst <= RTOL, f"rank {r}: per-step loss differs by {worst:.2e} relative"
    sa, sb = ref.state(), got.state()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        scale = sa[k].abs().max().clamp_min(1e-12)
        rel = ((sa[k] - sb[k]).abs().max() / scale).item()
        assert rel <= RTOL, f"{k}: final weights differ by {rel:.2e} relative"
