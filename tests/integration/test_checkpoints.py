"""Distributed checkpoints on 2 CPU ranks: exact resume, resharding to 1 rank, no damage from a killed save."""

from __future__ import annotations

import pytest
import torch

from slidedp_lightning.checkpoints.distributed import META
from tests.integration.conftest import BATCH, shm_files

pytestmark = pytest.mark.slow  # multi-process jobs

STEPS, SAVE_AT = 10, 5
COMMON = dict(strategy="slidedp", tied=True, batch=BATCH, constant_data=True, grad_route="host_reduce")


def _ok(res):
    assert res.returncode == 0, res.output[-4000:]
    return res


@pytest.fixture(scope="module")
def straight(job_runner):
    """10 steps in one go, saving a checkpoint after step 5 on the way."""
    return _ok(job_runner("ckpt_straight", devices=2, steps=STEPS, save_at=SAVE_AT, **COMMON))


@pytest.mark.integration
def test_save_and_resume_equals_training_straight_through_bit_for_bit(job_runner, straight):
    ckpt = straight.out / "ck"
    assert (ckpt / META).is_file()
    resumed = _ok(job_runner("ckpt_resumed", devices=2, steps=STEPS, ckpt_path=str(ckpt), **COMMON))
    for rank in range(2):
        assert resumed.losses(rank) == straight.losses(rank)[SAVE_AT:], f"rank {rank}: losses after resume differ"
    a, b = straight.state(), resumed.state()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"


@pytest.mark.integration
def test_a_two_rank_checkpoint_resumes_on_one_rank(job_runner, straight):
    one = _ok(
        job_runner(
            "ckpt_one_rank",
            devices=1,
            steps=STEPS,
            ckpt_path=str(straight.out / "ck"),
            distributed_sampler=False,
            **COMMON,
        )
    )
    ref = straight.losses(0)[SAVE_AT:]
    got = one.losses(0)
    assert len(got) == len(ref)
    assert max(abs(x - y) / abs(y) for x, y in zip(got, ref)) <= 1e-6
    a, b = straight.state(), one.state()
    for k in a:
        assert ((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-12)).item() <= 1e-5, k


@pytest.mark.integration
def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint_loadable(job_runner, straight, tmp_path):
    """SIGKILL of rank 1 inside the second save: the job ends within the timeout, no shared memory is left,
    and the checkpoint at that path is still the complete first one."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(straight.out / "ck", ck)  # a complete checkpoint of step 5 already sits at the path
    killed = job_runner(
        "ckpt_killed", devices=2, steps=STEPS, save_at=7, save_path=str(ck), kill_in_save=1, pg_timeout=20, **COMMON
    )
    assert killed.returncode != 0
    assert not shm_files(), "a shared-memory ledger file was left behind"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") and "old" in p.name]
    resumed = _ok(job_runner("ckpt_after_kill", devices=2, steps=STEPS, ckpt_path=str(ck), **COMMON))
    assert resumed.losses(0) == straight.losses(0)[SAVE_AT:], "the surviving checkpoint is not the step-5 one"


@pytest.mark.integration
def test_moments_on_disk_a_rank_killed_in_an_update_leaves_its_checkpoint_exact(job_runner, straight):
    """The moments in a state file on disk: rank 1 SIGKILLed inside an update after the step-5 save; the job ends,
    nothing is left in the state directory or shared memory, and the checkpoint resumes (moments on disk again)
    to the same bits as training straight through in memory."""
    disk = dict(COMMON, state_on_disk=True)
    killed = job_runner(
        "ckpt_disk_killed", devices=2, steps=STEPS, save_at=SAVE_AT, kill_at_step=7, kill_in="update", pg_timeout=20,
        **disk,
    )  # fmt: skip
    assert killed.returncode != 0
    assert not shm_files(), "a shared-memory ledger file was left behind"
    assert list((killed.out / "state").iterdir()) == [], "the state file outlived the job"
    resumed = _ok(job_runner("ckpt_disk_resumed", devices=2, steps=STEPS, ckpt_path=str(killed.out / "ck"), **disk))
    for rank in range(2):
        assert resumed.losses(rank) == straight.losses(rank)[SAVE_AT:], f"rank {rank}: losses after resume differ"
    a, b = straight.state(), resumed.state()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"


@pytest.mark.integration
@pytest.mark.parametrize("route", [{"grad_route": "host_reduce"}, {"param_route": "sharded", "chunk_bytes": 4096}],
                         ids=["host_reduce", "sharded-chunk4KiB"])  # fmt: skip
def test_the_master_on_disk_trains_and_resumes_as_the_master_in_memory(job_runner, route):
    """bf16-mixed on 2 ranks sharing one state file that holds the FP32 master and the moments (local rank 0 fills
    it, both update their shards through it): the same losses and final weights as the ledger in memory, a
    checkpoint saved from the file, and a resume into the file (and into memory) that ends where the run ends."""
    common = dict(strategy="slidedp", tied=True, batch=BATCH, constant_data=True, precision="bf16-mixed", **route)
    name = "-".join(f"{k}{v}" for k, v in route.items())
    memory = _ok(job_runner(f"master_mem_{name}", devices=2, steps=STEPS, save_at=SAVE_AT, **common))
    disk = dict(common, state_on_disk=True, master_on_disk=True)
    got = _ok(job_runner(f"master_disk_{name}", devices=2, steps=STEPS, save_at=SAVE_AT, **disk))
    assert list((got.out / "state").iterdir()) == [], "the state file outlived the job"
    assert "master+exp_avg+exp_avg_sq in a" in got.output and "torch.bfloat16" in got.output, got.output[-3000:]
    for rank in range(2):
        assert got.losses(rank) == memory.losses(rank), f"rank {rank}: losses differ"
    a, b = memory.state(), got.state()
    assert all(torch.equal(a[k], b[k]) for k in a)
    for source, into in ((got, disk), (memory, disk), (got, common)):
        resumed = _ok(job_runner(f"master_resumed_{name}_{source is got}_{into is disk}", devices=2, steps=STEPS,
                                 ckpt_path=str(source.out / "ck"), **into))  # fmt: skip
        for rank in range(2):
            assert resumed.losses(rank) == memory.losses(rank)[SAVE_AT:], f"rank {rank}: losses after resume differ"
        c = resumed.state()
        assert all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.integration
def test_the_weights_a_job_ends_with_hold_a_slow_disks_last_writes(job_runner):
    """The master on disk, rank 1's state-file writes each 0.3 s slow: the weights rank 0 reads from the file as the
    job ends (each unit's whole master, rank 1's shard too) hold rank 1's last update, as the master in memory does.
    A rank's update stamp alone says its update ran, not that its records reached the file."""
    common = dict(strategy="slidedp", tied=True, batch=BATCH, constant_data=True, precision="bf16-mixed",
                  grad_route="host_reduce")  # fmt: skip
    memory = _ok(job_runner("master_mem_grad_routehost_reduce", devices=2, steps=STEPS, save_at=SAVE_AT, **common))
    slow = _ok(job_runner("master_disk_slow_writes", devices=2, steps=STEPS, state_on_disk=True, master_on_disk=True,
                          slow_writes_rank=1, **common))  # fmt: skip
    for rank in range(2):
        assert slow.losses(rank) == memory.losses(rank), f"rank {rank}: losses differ"
    a, b = memory.state(), slow.state()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs: rank 1's last writes were not in the file when it was read"


@pytest.mark.integration
def test_a_rank_killed_in_an_update_with_the_master_on_disk_leaves_its_checkpoint_exact(job_runner):
    """The master on disk (bf16-mixed): rank 1 SIGKILLed inside an update after the step-5 save leaves a master half
    updated in the state file, which goes with the job; the checkpoint resumes into a new state file to the same bits
    as training straight through with the master in memory."""
    common = dict(strategy="slidedp", tied=True, batch=BATCH, constant_data=True, precision="bf16-mixed",
                  grad_route="host_reduce")  # fmt: skip
    memory = _ok(job_runner("master_mem_grad_routehost_reduce", devices=2, steps=STEPS, save_at=SAVE_AT, **common))
    disk = dict(common, state_on_disk=True, master_on_disk=True)
    killed = job_runner("master_disk_killed", devices=2, steps=STEPS, save_at=SAVE_AT, kill_at_step=7,
                        kill_in="update", pg_timeout=20, **disk)  # fmt: skip
    assert killed.returncode != 0
    assert not shm_files(), "a shared-memory ledger file was left behind"
    assert list((killed.out / "state").iterdir()) == [], "the state file outlived the job"
    resumed = _ok(job_runner("master_disk_killed_resumed", devices=2, steps=STEPS, ckpt_path=str(killed.out / "ck"),
                             **disk))  # fmt: skip
    for rank in range(2):
        assert resumed.losses(rank) == memory.losses(rank)[SAVE_AT:], f"rank {rank}: losses after resume differ"
    a, b = memory.state(), resumed.state()
    assert all(torch.equal(a[k], b[k]) for k in a)
