"""slidedp-finetune --checkpoint-dir / --resume: a run killed with SIGKILL after its second checkpoint and started
again with --resume auto ends with the weights of the same run done in one go, bit for bit (FP32 compute, int8
moments, full recomputation, accumulation, packed rows, across an epoch boundary); the data order, the schedule and
the step continue where the checkpoint left them. A run sent SIGTERM saves at the end of that step, exits 143, and
resumes from there to the same weights."""

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
        "--results", str(tmp / f"{name}.json"), "--log-dir", str(tmp / f"logs-{name}"), "--pack",
    ]  # fmt: skip


def _started(tmp: Path, name: str) -> tuple[subprocess.Popen, Path]:
    log = tmp / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(_job(tmp, name), cwd=tmp, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    return proc, log


def _wait_for(path: Path, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 600
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.02)


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
    write_data(str(tmp_path / "train.jsonl"), 128, rng)  # packed 2 a row: 8 batches of 4 a rank, 4 steps an epoch

    whole = subprocess.run(_job(tmp_path, "whole"), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]

    assert "plan: " in whole.stderr and "--pack: 128 examples in 64 rows" in whole.stderr, whole.stderr[-3000:]
    proc, log = _started(tmp_path, "resumed")
    _wait_for(tmp_path / "ck-resumed" / "step=6.ckpt", proc, log)
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
    assert report["checkpoint"] == str(tmp_path / "ck-resumed" / "step=10.ckpt")  # the last step is always saved

    want, got = _weights(tmp_path / "out-whole"), _weights(tmp_path / "out-resumed")
    assert sorted(got) == sorted(want) and want
    different = [n for n in want if not torch.equal(got[n], want[n])]
    assert not different, different
    kept = sorted(p.name for p in (tmp_path / "ck-whole").iterdir())
    assert kept == ["step=10.ckpt", "step=9.ckpt"], kept  # every 3 steps and the last, --keep-last 2

    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out-resumed", dtype=torch.float32)
    for name, value in reloaded.state_dict().items():
        assert name not in want or torch.equal(value, want[name]), name

    # SIGTERM to the launching rank during a step: the step ends, every rank saves, the job stops with 143
    proc, log = _started(tmp_path, "term")
    _wait_for(tmp_path / "ck-term" / "step=3.ckpt", proc, log)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=600) == 143, log.read_text()[-3000:]
    saved = sorted(int(p.name[5:-5]) for p in (tmp_path / "ck-term").iterdir())
    assert saved[-1] > 3 and saved[-1] < 10, (saved, log.read_text()[-3000:])  # a step's end, not the last
    assert "on a signal; stopping" in log.read_text() and not (tmp_path / "out-term").exists()
    again = subprocess.run([*_job(tmp_path, "term"), "--resume", "auto"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=600)  # fmt: skip
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert f"resuming from {tmp_path / 'ck-term' / f'step={saved[-1]}.ckpt'}" in again.stderr
    got = _weights(tmp_path / "out-term")
    different = [n for n in want if not torch.equal(got[n], want[n])]
    assert not different, different
