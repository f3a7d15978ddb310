"""slidedp-finetune checks every output path before it trains (one line naming the flag, the cause and the fix),
and refuses a --data folder as such."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slidedp_lightning.recipes.data import DataError, read_jsonl
from slidedp_lightning_cli.finetune import main

ROOT = Path(__file__).resolve().parents[2]


def _refused(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    return err


def test_an_export_path_that_is_a_file_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "qwen3"}')  # checked before the outputs
    (tmp_path / "data.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    (tmp_path / "out").write_text("not a directory")
    base = ["--model", str(tmp_path / "model"), "--data", str(tmp_path / "data.jsonl")]
    err = _refused(capsys, [*base, "--export", str(tmp_path / "out")])
    assert "--export" in err and "is not a directory" in err, err
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "notes.txt").write_text("x")
    err = _refused(capsys, [*base, "--export", str(tmp_path / "stuff")])
    assert "not a Hugging Face model" in err, err
    err = _refused(capsys, [*base, "--results", str(tmp_path)])
    assert "--results" in err and "is a directory" in err, err
    err = _refused(capsys, ["--log-dir", str(tmp_path / "out" / "logs")])
    assert "--log-dir" in err and "not a writable directory" in err, err


def test_a_data_directory_is_refused_as_a_directory(tmp_path):
    with pytest.raises(DataError, match="is a directory: pass a JSONL file"):
        read_jsonl(str(tmp_path))


SLOW_SETUP = """
import time, sys, torch, lightning as L
from pathlib import Path
import slidedp_lightning
from tests.trainers import TinyLM, data

class Slow(TinyLM):
    def configure_model(self):
        Path(sys.argv[1]).write_text("in setup")
        time.sleep(60)

L.Trainer(strategy="slidedp", accelerator="cpu", devices=1, max_steps=1, logger=False,
          enable_checkpointing=False, enable_progress_bar=False).fit(Slow(), data())
"""


@pytest.mark.slow
def test_sigterm_during_setup_says_why_the_rank_stopped(tmp_path):
    (tmp_path / "job.py").write_text(SLOW_SETUP)
    marker = tmp_path / "marker"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "job.py"), str(marker)], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 90
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "received SIGTERM outside the training loop" in err, err[-2000:]
