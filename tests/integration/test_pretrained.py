"""Two ranks from a pretrained checkpoint: SlideDP reading it straight into the ledger equals DDP + AdamW loading the
same checkpoint with transformers, per-step losses and final weights within 1e-5 relative (FP32, CPU).

The job loads its ``pretrained`` directory with ``slidedp_lightning.from_pretrained`` in ``configure_model``
(transformers' own ``from_pretrained`` under DDP).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

STEPS = 20
BATCH = 4
RTOL = 1e-5

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # multi-process jobs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A BF16 checkpoint of the job's untied tiny Qwen3 in several safetensors shards, weights unlike its init."""
    from tests.integration.job import tiny_config

    directory = tmp_path_factory.mktemp("pretrained") / "qwen3-tiny"
    torch.manual_seed(99)
    model = Qwen3ForCausalLM(tiny_config(tied=False)).to(torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="60KB")
    return directory


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def test_two_ranks_from_a_checkpoint_equal_ddp_from_the_same_checkpoint(job_runner, checkpoint) -> None:
    common = {"devices": 2, "tied": False, "steps": STEPS, "batch": BATCH, "pretrained": str(checkpoint)}
    ref = job_runner("pretrained_ddp", strategy="ddp", **common)
    got = job_runner("pretrained_slidedp", strategy="slidedp", dump_initial=True, **common)
    assert ref.returncode == 0, ref.output[-4000:]
    assert got.returncode == 0, got.output[-4000:]
    assert "materialized on every rank" not in got.output  # not the naive path
    # the checkpoint's conversion kernels ran on the training thread and left its torch threads as DDP's
    share = max(1, os.cpu_count() // 2)
    assert [got.threads(r) for r in range(2)] == [ref.threads(r) for r in range(2)] == [share] * 2
    assert f", {share} torch thread(s), " in got.output  # the setup log says it
    expected = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, local_files_only=True)
    initial = torch.load(got.out / "initial_state.pt")
    for name, value in expected.state_dict().items():
        assert torch.equal(initial[f"model.{name}"], value), name  # the ledger started from the checkpoint
    for rank in range(2):
        a, b = ref.losses(rank), got.losses(rank)
        assert len(a) == len(b) == STEPS
        worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
        assert worst <= RTOL, f"rank {rank}: per-step loss differs by {worst:.2e} relative"
    final_ref, final_got = ref.state(), got.state()
    assert sorted(final_ref) == sorted(final_got)
    for name in final_ref:
        assert _relative(final_got[name], final_ref[name]) <= RTOL, name
