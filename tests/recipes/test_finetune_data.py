"""End to end: ``experiments/finetune_own_data.py`` (tokenizer, tiny Qwen3, JSONL data generated offline) runs
``slidedp-finetune --model --data --export`` on 2 CPU ranks; the model learns, the export reloads with transformers
and reproduces the final validation loss, TensorBoard has the loss, learning rate and tokens/s."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "experiments", "finetune_own_data.py")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["slidedp", "ddp"])
def test_own_data_end_to_end(tmp_path, strategy):
    work = tmp_path / "run"
    # 150 of the example's 200 steps: both strategies answer every prompt exactly after 150 (0.64 after 100)
    cmd = [
        sys.executable,
        EXAMPLE,
        "--workdir",
        str(work),
        "--strategy",
        strategy,
        "--timeout",
        "600",
        "--max-steps",
        "150",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((work / "summary.json").read_text())

    # validation loss falls clearly, answer accuracy (greedy model.generate) rises
    assert summary["val_loss_after"] < 0.25 * summary["val_loss_before"], summary
    assert summary["val_acc_after"] > summary["val_acc_before"] + 0.5, summary
    assert summary["generate_acc_before"] < 0.1 and summary["generate_acc_after"] > 0.6, summary
    # FP32 export (--precision 32-true) reloaded with transformers: same validation loss
    assert abs(summary["export_val_loss"] - summary["val_loss_after"]) < 1e-3, summary

    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = work / "export"
    tok = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export)
    assert tok.chat_template and tok.eos_token == "<|endoftext|>"
    assert model.get_input_embeddings().num_embeddings >= len(tok)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (version,) = (work / "logs").iterdir()
    events = EventAccumulator(str(version))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train_loss", "train_tokens_per_s", "val_loss", "val_acc", "lr-AdamW/pg1"} <= tags, tags
    assert all(e.value > 0 for e in events.Scalars("train_tokens_per_s"))
    assert "step_s" in tags and all(e.value > 0 for e in events.Scalars("step_s"))
