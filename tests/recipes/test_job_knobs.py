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
    # the SlideDP run takes its settings from a file (every rank reads it), the DDP run from flags
    printed = subprocess.run([str(CLI), "--model", model, *TRAINING, "--activation-policy", "full", "--print-config"],
                             capture_output=True, text=True, timeout=60, check=True).stdout  # fmt: skip
    (tmp_path / "job.yaml").write_text(printed)
    ours, _ = _run(tmp_path, "slidedp", ["--config", str(tmp_path / "job.yaml")])
    ddp, _ = _run(tmp_path, "ddp", ["--model", model, *TRAINING, "--strategy", "ddp"])
    (written,) = (tmp_path / "logs-slidedp").glob("version_*/config.yaml")
    assert written.read_text().startswith("# slidedp-finetune --config ")
    from slidedp_lightning_cli.finetune import parse

    again = vars(parse(["--config", str(written)]))
    want = vars(parse(["--config", str(tmp_path / "job.yaml"), "--results", str(tmp_path / "slidedp.json"),
                       "--log-dir", str(tmp_path / "logs-slidedp")]))  # fmt: skip
    assert {k: v for k, v in again.items() if k != "config"} == {k: v for k, v in want.items() if k != "config"}
    assert ours["steps"] == ddp["steps"] == 4
    assert ours["tokens_per_s"] > 0 and ours["step_s"] > 0 and ddp["tokens_per_s"] > 0
    assert 14 <= ours["ledger_bytes_per_param"] < 16 and ddp["ledger_bytes"] is None  # FP32 master, moments, copy
    # the launching process measured the job's host memory: both ranks, the ledger counted once
    assert ours["peak_host_processes"] == 2 and ours["ledger_bytes"] < ours["peak_host_bytes"] < 8 * 1024**3, ours
    assert ours["plan"]["verdict"] == "fits" and ours["plan"]["params_counted"] == "safetensors headers", ours
    assert ours["plan"]["ledger_bytes"] <= ours["ledger_bytes"] <= 1.05 * ours["plan"]["ledger_bytes"]  # + padding
    assert ours["exposed_host_share"] is None and ddp["plan"] is None  # measured with --trace-dir only
    assert math.isclose(ours["train_loss"], ddp["train_loss"], rel_tol=0, abs_tol=1e-4), (ours, ddp)
    assert math.isclose(ours["after"]["val_loss"], ddp["after"]["val_loss"], rel_tol=0, abs_tol=1e-4), (ours, ddp)

    # the moments in a state file on disk: the same run to the bit, a ledger in memory without them
    (tmp_path / "state").mkdir()
    disk, log = _run(tmp_path, "disk", ["--config", str(tmp_path / "job.yaml"), "--state-dir", str(tmp_path / "state")])
    assert (disk["train_loss"], disk["after"]["val_loss"]) == (ours["train_loss"], ours["after"]["val_loss"])
    assert 6 <= disk["ledger_bytes_per_param"] < 8 and "state file in" in log, log[-3000:]
    assert disk["plan"]["verdict"] == "fits" and disk["plan"]["ledger_bytes"] <= disk["ledger_bytes"], disk
    assert list((tmp_path / "state").iterdir()) == []

    compact, log = _run(tmp_path, "int8", ["--model", model, "--max-steps", "6", "--optimizer-state", "int8",
                                           "--no-bf16-copy", "--lr", "3e-3", "--trace-dir",
                                           str(tmp_path / "trace")])  # fmt: skip
    assert f"--model {model}: activation policy 'full' (--activation-policy none turns it off)" in log, log[-3000:]
    assert "the loss in chunks of 1024 tokens (--chunked-loss 0 turns it off)" in log, log[-3000:]
    assert compact["steps"] == 6 and math.isfinite(compact["train_loss"])
    assert 6 <= compact["ledger_bytes_per_param"] < 8  # FP32 master and int8 moments, no copy
    assert 0 <= compact["exposed_host_share"] < 1 and "host work exposed" in log, compact
    assert compact["after"]["val_loss"] < compact["before"]["val_loss"], compact


@pytest.mark.slow
def test_a_lora_job_exports_the_merged_model_or_its_adapters(tmp_path):
    import random

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
    from finetune_own_data import build_model, build_tokenizer, write_data

    rng = random.Random(0)
    base = tmp_path / "base"
    build_model(str(base), build_tokenizer(str(base), rng), seed=0)
    write_data(str(tmp_path / "train.jsonl"), 64, rng)
    job = ["--model", str(base), "--data", str(tmp_path / "train.jsonl"), "--seq-len", "32", "--batch-size", "4",
           "--max-epochs", "1", "--precision", "32-true", "--lr", "1e-2", "--lora-r", "8"]  # fmt: skip
    results, _ = _run(tmp_path, "lora", [*job, "--export", str(tmp_path / "merged"), "--val-split", "0.25"])
    assert results["steps"] == 6 and math.isfinite(results["train_loss"])  # one pass: 48 training examples, 2 x 4

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    got, want = merged.state_dict(), original.state_dict()
    assert sorted(got) == sorted(want)  # a transformers model, no peft names left
    adapted = [n for n in want if n.endswith(("q_proj.weight", "down_proj.weight"))]
    assert adapted and all(not torch.equal(got[n], want[n]) for n in adapted)  # every linear layer merged
    kept = [n for n in want if "norm" in n or "embed_tokens" in n]
    assert kept and all(torch.equal(got[n], want[n]) for n in kept)  # frozen: the checkpoint's weights

    _run(tmp_path, "adapters", [*job, "--lora-targets", "q_proj,v_proj", "--export", str(tmp_path / "adapters"),
                                "--export-adapter-only"])  # fmt: skip
    config = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    tensors = load_file(tmp_path / "adapters" / "adapter_model.safetensors")
    assert tensors and all("lora_" in n for n in tensors)


@pytest.mark.slow
def test_the_master_on_disk_trains_as_the_ledger_in_memory(tmp_path):
    """bf16-mixed with --state-dir --master-on-disk: the same losses as the ledger in memory, 2 B/param of ledger (the
    BF16 copy), the state file named in the log and gone after."""
    model = _checkpoint(tmp_path / "ckpt")
    job = ["--model", model, "--precision", "bf16-mixed", "--max-steps", "4", "--batch-size", "4", "--val-every", "2",
           "--optimizer-state", "int8"]  # fmt: skip
    memory, _ = _run(tmp_path, "memory", job)
    (tmp_path / "state").mkdir()
    disk, log = _run(tmp_path, "disk", [*job, "--state-dir", str(tmp_path / "state"), "--master-on-disk"])
    assert (disk["train_loss"], disk["after"]["val_loss"]) == (memory["train_loss"], memory["after"]["val_loss"])
    assert 2 <= disk["ledger_bytes_per_param"] < 2.5 and "master+exp_avg+exp_avg_sq" in log, log[-3000:]
    assert disk["plan"]["verdict"] == "fits" and disk["plan"]["ledger_bytes"] <= disk["ledger_bytes"], disk
    assert list((tmp_path / "state").iterdir()) == []
