"""bench/gpu_check.py stays runnable: its CPU dry run exercises every code path but the CUDA specifics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a benchmark script run end to end

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_gpu_check_dry_run_on_cpu(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_check.py"),
            "--device",
            "cpu",
            "--tiny",
            "--batch",
            "2",
            "--seq",
            "32",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--large-batch",
            "4",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    for system in ("plain", "slidedp"):
        assert "error" not in report[system], report[system]
        assert report[system]["tokens_per_s"] > 0
    # the same initial weights and batches: BF16 weights (SlideDP) vs FP32 weights under BF16 autocast (plain)
    assert all(loss == loss for loss in report["slidedp"]["losses"])  # no NaN
    assert report["max_abs_loss_diff"] <= 1e-2
    assert report["slidedp"]["ledger_bytes"] >= 14 * report["params"]
    large = report["large"]  # the second case: a larger batch, every block checkpointed in both systems
    assert large["batch"] == 4 and large["checkpointing"]
    for system in ("plain", "slidedp"):
        assert "error" not in large[system], large[system]
        assert large[system]["tokens_per_s"] > 0
    assert large["slidedp"]["exposed_host"] is not None
    assert large["max_abs_loss_diff"] <= 1e-2
    assert (tmp_path / "slidedp_trace" / "trace_rank0.json").exists()
    assert proc.stdout.strip().splitlines()[-1].startswith("json:")


@pytest.mark.integration
def test_gpu_check_dry_run_of_the_compact_case_alone(tmp_path):
    """The 8 B case's flags: one checkpointed case, each system initialized on its own device, int8 moments
    without the BF16 copy."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    args = "--device cpu --tiny --batch 0 --large-batch 4 --seq 32 --steps 3 --warmup 1 --meta-init"
    args += " --optimizer-state int8 --no-bf16-copy"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), *args.split(), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "plain" not in report and report["optimizer_state"] == "int8" and not report["bf16_copy"]
    large = report["large"]
    for system in ("plain", "slidedp"):
        assert "error" not in large[system], large[system]
    assert "max_abs_loss_diff" not in large  # different initial weights: no comparison
    assert 6 * report["params"] <= large["slidedp"]["ledger_bytes"] < 6.2 * report["params"]
    assert (tmp_path / "slidedp_trace" / "trace_rank0.json").exists()  # the one case keeps its trace
