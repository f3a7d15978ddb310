"""slidedp-finetune --checkpoint-dir / --resume: a run killed with SIGKILL after its second checkpoint and started
again with --resume auto ends with the weights of the same run done in one go, bit for bit (FP32 compute, int8
moments, full recomputation, accumulation, across an epoch boundary); the data order, the schedule and the step
continue where the checkpoint left them."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

CLI = Path(sys.executable).with_name("slidedp-finetune")
ROOT = Path(__file__).resolve().parents[2]


def _job(tmp: Path, name: str) -> list[str]:
    return [
        str(CLI), "--model", str(tmp / "base"), "--data", str(tmp / "train.jsonl"), "--seq-len", "32",
        "--batch-size", "4", "--accumulate-grad-batches", "2", "--max-steps", "10", "--precision", "32-true",
        "--lr", "1e-2", "--optimizer-state", "int8", "--activation-policy", "full", "--checkpoint-every", "3",
        "--checkpoint-dir", str(tmp / f"ck-{name}"), "--export", str(tmp / f"out-{name}"),
        "--results", str(tmp / f"{name}.json"), "--log-dir", str(tmp / f"logs-{name}"),
    ]  # fmt: skip


def _weights(directory: Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.slow
def test_a_killed_run_resumed_ends_bit_for_bit_where_the_whole_run_ends(tmp_path):
    import torch

    sys.path.insert(0, str(ROOT / "experiments"))
    from finetune_own_data import build_model, build_tokenizer, write_data

    rng = random.Random(0)
    build_model(str(tmp_path / "base"), build_tokenizer(str(tmp_path / "base"), rng), seed=0)
    write_data(str(tmp_path / "train.jsonl"), 64, rng)  # 8 batches of 4 a rank: 4 steps an epoch

    whole = subprocess.run(_job(tmp_path, "whole"), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]

    log = open(tmp_path / "killed.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(_job(tmp_path, "resumed"), cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 600
    while not (tmp_path / "ck-resumed" / "step=6.ckpt").exists():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "killed.log").read_text()[-3000:]
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks, no cleanup
    proc.wait()
    assert not (tmp_path / "out-resumed").exists() and not (tmp_path / "resumed.json").exists()

    changed = subprocess.run([*_job(tmp_path, "resumed"), "--resume", "auto", "--optimizer-state", "fp32"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert changed.returncode == 2, changed.stderr[-3000:]
    assert "written with --optimizer-state int8, this run has --optimizer-state fp32" in changed.stderr

    again = subprocess.run([*_job(tmp_path, "resumed"), "--resume", "auto"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=600)  # fmt: skip
    output = again.stdout + again.stderr
    assert again.returncode == 0, output[-3000:]
    assert "resuming from " + str(tmp_path / "ck-resumed" / "step=") in output, output[-3000:]
    report = json.loads((tmp_path / "resumed.json").read_text())
    assert report["steps"] == 10 and report["export"] == str(tmp_path / "out-resumed")
    assert report["checkpoint"] == str(tmp_path / "ck-resumed" / "step=9.ckpt")

    want, got = _weights(tmp_path / "out-whole"), _weights(tmp_path / "out-resumed")
    assert sorted(got) == sorted(want) and want
    different = [n for n in want if not torch.equal(got[n], want[n])]
    assert not different, different
    kept = sorted(p.name for p in (tmp_path / "ck-whole").iterdir())
    assert kept == ["step=6.ckpt", "step=9.ckpt"], kept  # every 3 steps, --keep-last 2
