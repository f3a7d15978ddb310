"""SLURM auto-requeue under SlideDP, with real signals: 2 ranks started as srun would (SLURM's variables), a fake
``scontrol`` on PATH that records its arguments."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from slidedp_lightning.checkpoints.distributed import read_meta
from tests.conftest import environment_for_a_job

pytestmark = [pytest.mark.slow, pytest.mark.integration]  # multi-process jobs

JOB = Path(__file__).with_name("reliability_job.py")

STEPS, JOB_ID = 8, "4242"
CFG = dict(steps=STEPS, slurm_requeue=True, constant_data=True, strategy={"grad_route": "host_reduce"})


def fake_scontrol(tmp: Path) -> Path:
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {tmp / "scontrol.log"}\n')
    script.chmod(0o755)
    return bin_dir


def launch(out: Path, bin_dir: Path, **cfg) -> list[subprocess.Popen]:
    """Both ranks of a 2-task SLURM job step, as srun starts them."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"out": str(out), **CFG, **cfg}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in environment_for_a_job().items() if "SLURM" not in k}
    base.update(
        PYTHONWARNINGS="ignore",
        OMP_NUM_THREADS="1",
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_ID=JOB_ID,
        SLURM_JOB_NAME="slidedp-requeue-test",
        SLURM_NTASKS="2",
        SLURM_NTASKS_PER_NODE="2",
        SLURM_NODEID="0",
        SLURM_NODELIST="127.0.0.1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    return [
        subprocess.Popen(
            [sys.executable, str(JOB), str(out / "config.json")],
            stdout=open(out / f"output_rank{r}.txt", "w"),
            stderr=subprocess.STDOUT,
            env={**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
        )
        for r in range(2)
    ]


def finish(procs: list[subprocess.Popen], out: Path, timeout: float = 240) -> tuple[list[int], str]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return codes, "\n".join((out / f"output_rank{r}.txt").read_text() for r in range(2))


def losses(out: Path, rank: int) -> list[tuple[int, float]]:
    return [tuple(x) for x in json.loads((out / f"losses_rank{rank}.json").read_text())]


def wait_for_step(out: Path, rank: int, step: int, procs: list[subprocess.Popen], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    path = out / f"step_rank{rank}"
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip() and int(path.read_text()) >= step:
            return
        assert all(p.poll() is None for p in procs), "a rank ended before the signal"
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} never reached step {step}")


def test_sigusr1_saves_an_hpc_checkpoint_requeues_and_the_requeued_job_continues_bit_for_bit(tmp_path):
    bin_dir = fake_scontrol(tmp_path)
    straight = tmp_path / "straight"
    codes, output = finish(launch(straight, bin_dir), straight)
    assert codes == [0, 0], output[-4000:]
    assert not (tmp_path / "scontrol.log").exists() and not list(straight.glob("hpc_ckpt_*"))

    # SIGUSR1 to rank 1 only, mid-training: every rank saves, rank 0 requeues, training goes on
    job = tmp_path / "job"
    procs = launch(job, bin_dir, step_sleep=0.3)
    wait_for_step(job, 1, 3, procs)
    os.kill(procs[1].pid, signal.SIGUSR1)
    codes, output = finish(procs, job)
    assert codes == [0, 0], output[-4000:]
    assert "received SIGUSR1 (SLURM auto-requeue)" in output, output[-4000:]
    assert (tmp_path / "scontrol.log").read_text().splitlines() == [f"requeue {JOB_ID}"]
    ckpts = sorted(job.glob("hpc_ckpt_*.ckpt"))
    assert [c.name for c in ckpts] == ["hpc_ckpt_1.ckpt"]
    saved_at = read_meta(ckpts[0])["global_step"]
    assert 3 <= saved_at < STEPS, saved_at
    for rank in (0, 1):
        assert losses(job, rank) == losses(straight, rank), "saving the checkpoint changed the run"

    # the requeued job: started again in the same place, it resumes from the HPC checkpoint by itself
    for rank in (0, 1):
        (job / f"losses_rank{rank}.json").unlink()
    codes, output = finish(launch(job, bin_dir), job)
    assert codes == [0, 0], output[-4000:]
    for rank in (0, 1):
        resumed = losses(job, rank)
        assert [s for s, _ in resumed] == list(range(saved_at, STEPS)), resumed
        assert resumed == losses(straight, rank)[saved_at:], f"rank {rank}: the continuation differs"
    a, b = torch.load(straight / "final_state.pt"), torch.load(job / "final_state.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "final weights differ"


def test_sigterm_under_auto_requeue_stops_every_rank_at_the_end_of_the_step(tmp_path):
    bin_dir = fake_scontrol(tmp_path)
    job = tmp_path / "job"
    procs = launch(job, bin_dir, step_sleep=0.3)
    wait_for_step(job, 0, 2, procs)
    os.kill(procs[0].pid, signal.SIGTERM)
    started = time.monotonic()
    codes, output = finish(procs, job, timeout=60)
    assert time.monotonic() - started < 30, output[-4000:]
    assert codes == [128 + signal.SIGTERM] * 2, (codes, output[-4000:])
    assert "received SIGTERM (SLURM auto-requeue): stopping at the end of this step" in output, output[-4000:]
    assert "stopping after step" in output
    assert not list(job.glob("hpc_ckpt_*")) and not (tmp_path / "scontrol.log").exists()
