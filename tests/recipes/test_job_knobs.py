"""slidedp-finetune's training and memory flags reach the run: in FP32 the SlideDP job with accumulation, clipping,
a linear schedule, weight decay, the chunked loss and full recomputation ends where the DDP job with the same
training flags ends; the compact ledger (int8 moments, no BF16 copy) trains; a real model gets recomputation and
the chunked loss by default, and the log says so."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

CLI = Path(sys.executable).with_name("slidedp-finetune")
TRAINING = [
    "--precision", "32-true", "--max-steps", "4", "--batch-size", "4", "--accumulate-grad-batches", "2",
    "--gradient-clip-val", "0.5", "--lr-schedule", "linear", "--weight-decay", "0.1", "--chunked-loss", "8",
    "--val-every", "2", "--lr", "3e-3",
]  # fmt: skip


def _checkpoint(out: Path) -> str:
    from transformers import AutoModelForCausalLM

    from slidedp_lightning.recipes.module import load_tiny_config

    config, attn = load_tiny_config()
    AutoModelForCausalLM.from_config(config, attn_implementation=attn).save_pretrained(out)
    return str(out)


def _run(tmp: Path, name: str, argv: list[str]) -> tuple[dict, str]:
    results = tmp / f"{name}.json"
    cmd = [str(CLI), *argv, "--results", str(results), "--log-dir", str(tmp / f"logs-{name}")]
    proc = subprocess.run(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return json.loads(results.read_text()), proc.stdout


@pytest.mark.slow
def test_the_training_flags_give_ddps_run_and_the_compact_ledger_trains(tmp_path):
    model = _checkpoint(tmp_path / "ckpt")
    ours, _ = _run(tmp_path, "slidedp", ["--model", model, *TRAINING, "--activation-policy", "full"])
    ddp, _ = _run(tmp_path, "ddp", ["--model", model, *TRAINING, "--strategy", "ddp"])
    assert ours["steps"] == ddp["steps"] == 4
    assert math.isclose(ours["train_loss"], ddp["train_loss"], rel_tol=0, abs_tol=1e-4), (ours, ddp)
    assert math.isclose(ours["after"]["val_loss"], ddp["after"]["val_loss"], rel_tol=0, abs_tol=1e-4), (ours, ddp)

    compact, log = _run(tmp_path, "int8", ["--model", model, "--max-steps", "6", "--optimizer-state", "int8",
                                           "--no-bf16-copy", "--lr", "3e-3"])  # fmt: skip
    assert f"--model {model}: activation policy 'full' (--activation-policy none turns it off)" in log, log[-3000:]
    assert "the loss in chunks of 1024 tokens (--chunked-loss 0 turns it off)" in log, log[-3000:]
    assert compact["steps"] == 6 and math.isfinite(compact["train_loss"])
    assert compact["after"]["val_loss"] < compact["before"]["val_loss"], compact
