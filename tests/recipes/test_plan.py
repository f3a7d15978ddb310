"""The job's plan before anything loads (:mod:`slidedp_lightning.recipes.plan`, ``slidedp-finetune --dry-run``):
parameters counted exactly from safetensors headers and estimated from a config.json alone, the ledger of each
optimizer state, the verdict on a host and the flag that makes a job fit; the dry run answers in under 2 s without
torch, and the real run of a job that cannot fit is refused before any ledger exists."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest

from slidedp_lightning.constants import ledger_bytes_per_param
from slidedp_lightning.recipes import plan
from tests.recipes.test_cli import CLI, RUNNER

GB = 10**9


def _save(directory: Path, tied: bool) -> int:
    """A tiny Qwen3 checkpoint; returns its parameter count as transformers counts it."""
    from tests.helpers import tiny_model

    model = tiny_model(tied=tied)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())  # a tied weight once


@pytest.mark.parametrize("tied", [True, False])
def test_parameters_are_counted_exactly_from_the_headers_and_estimated_from_the_config(tmp_path, tied):
    want = _save(tmp_path, tied)
    exact = plan.read_model(str(tmp_path))
    assert (exact.params, exact.counted) == (want, "safetensors headers")
    assert len(exact.matrices) == 2 * 7  # q, k, v, o, gate, up, down of each block
    estimate = plan.read_model(str(tmp_path / "config.json"))  # a config alone: the Qwen3 formula
    assert (estimate.params, estimate.counted) == (want, "config.json (estimate)")
    assert sorted(estimate.matrices) == sorted(exact.matrices)


def test_lora_adapters_are_counted_as_peft_counts_them(tmp_path):
    peft = pytest.importorskip("peft")
    from tests.helpers import tiny_model

    _save(tmp_path, tied=True)
    model = plan.read_model(str(tmp_path))
    for targets, peft_targets in (("all-linear", "all-linear"), (("q_proj", "v_proj"), ["q_proj", "v_proj"])):
        lora = peft.get_peft_model(tiny_model(), peft.LoraConfig(r=4, target_modules=peft_targets))
        want = sum(p.numel() for p in lora.parameters() if p.requires_grad)
        setup = plan.Setup(ranks=1, lora_r=4, lora_targets=targets)
        assert plan.plan(model, setup, HOST).trainable == want


HOST = plan.Host(mem_available=24 * GB, shared_free=16 * GB, shared_dir="/dev/shm")


def test_the_ledger_of_each_optimizer_state_and_the_verdict():
    model = plan.Model(params=GB, counted="test")
    exact = plan.plan(model, plan.Setup(ranks=2), HOST)
    assert exact.ledger_bytes == 14 * GB and exact.verdict == "fits"
    assert exact.rest_bytes == 2 * plan.REST_PER_RANK_BYTES["fp32"]
    replicated = plan.plan(model, plan.Setup(ranks=2, param_route="replicated"), HOST)
    assert replicated.ledger_bytes == 28 * GB and replicated.verdict == "does not fit"  # one ledger per rank
    int8 = plan.plan(model, plan.Setup(ranks=2, optimizer_state="int8", bf16_copy=False), HOST)
    assert int8.ledger_bytes == int(GB * ledger_bytes_per_param("int8", False))
    # the ledger fits, the ranks' estimated rest does not: tight, not refused
    tight = plan.plan(plan.Model(params=GB, counted="test"), plan.Setup(ranks=2), plan.Host(15 * GB, 16 * GB, "x"))
    assert tight.verdict == "tight"


def test_moments_on_disk_leave_the_ledger_and_need_their_space_there(tmp_path, monkeypatch):
    model = plan.Model(params=GB, counted="test")
    disk = plan.plan(model, plan.Setup(ranks=2, state_dir=str(tmp_path)), HOST)
    assert disk.ledger_bytes == 6 * GB and disk.disk_bytes == 8 * GB  # FP32 master + BF16 copy; both moments
    int8 = plan.plan(model, plan.Setup(ranks=2, optimizer_state="int8", state_dir=str(tmp_path)), HOST)
    assert int8.ledger_bytes == 6 * GB and int8.disk_bytes == int(GB * (ledger_bytes_per_param("int8") - 6))
    assert "--state-dir" in " ".join(disk.setup.flags()) and any("state file in" in line for line in disk.lines())
    monkeypatch.setattr(plan.shutil, "disk_usage", lambda path: SimpleNamespace(free=7 * GB))  # 8 GB needed
    small = plan.plan(model, plan.Setup(ranks=2, state_dir=str(tmp_path)), HOST)
    assert small.verdict == "does not fit" and "state file" in small.summary(), small.summary()


def test_the_master_on_disk_leaves_the_bf16_copy_alone_in_the_ledger(tmp_path):
    model = plan.Model(params=GB, counted="test")
    both = plan.plan(model, plan.Setup(ranks=2, state_dir=str(tmp_path), master_on_disk=True), HOST)
    assert both.ledger_bytes == 2 * GB and both.disk_bytes == 12 * GB  # the BF16 copy; master and both moments
    int8 = plan.plan(model, plan.Setup(ranks=2, optimizer_state="int8", state_dir=str(tmp_path), master_on_disk=True),
                     HOST)  # fmt: skip
    assert int8.ledger_bytes == 2 * GB and int8.disk_bytes == int(GB * (ledger_bytes_per_param("int8") - 2))
    assert both.setup.flags()[-1] == "--master-on-disk"
    assert any("(the FP32 master and the Adam moments)" in line for line in both.lines()), both.lines()


def test_a_job_that_does_not_fit_names_the_smallest_change_that_does():
    big = plan.Model(params=int(1.5 * GB), counted="test")  # exact: 21 GB, more than the 16 GB of shared memory
    job = plan.plan(big, plan.Setup(ranks=2), HOST)
    assert job.verdict == "does not fit"
    assert job.fix() == "--optimizer-state int8"  # 12.0 GB <= 16 GB, + 4.6 GB of the ranks' rest <= 24 GB
    text = "\n".join(job.lines())
    assert "DOES NOT FIT" in text and "fits with: --optimizer-state int8" in text
    bigger = plan.plan(plan.Model(params=2 * GB, counted="test"), plan.Setup(ranks=2), HOST)
    assert bigger.fix() == "--optimizer-state int8 --no-bf16-copy"  # int8 alone: 16.02 GB > 16 GB
    replicated = plan.plan(big, plan.Setup(ranks=4, param_route="replicated", optimizer_state="int8"),
                           plan.Host(20 * GB, 16 * GB, "/dev/shm"))  # fmt: skip
    assert replicated.fix() == "--devices 1"  # one ledger a rank: fewer ranks, fewer ledgers
    assert plan.plan(plan.Model(params=100 * GB, counted="test"), plan.Setup(ranks=1), HOST).fix() is None


def _config_too_big_for_this_host(directory: Path) -> int:
    """A Qwen3 config.json whose exact ledger exceeds this host's free memory by a fifth; returns its layers."""
    host = plan.read_host()
    free = min(host.mem_available, host.shared_free)
    config = json.loads(Path(plan.__file__).with_name("configs").joinpath("qwen3_tiny.json").read_text())
    config.update(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, vocab_size=151936, tie_word_embeddings=True)  # fmt: skip
    config.pop("attn_implementation", None)
    per_layer = 4 * 2048 * 2048 + 3 * 2048 * 6144  # the Qwen3-1.7B block's matrices, about 50 M
    layers = max(1, int(1.2 * free / 14 / per_layer))
    config["num_hidden_layers"] = layers
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return layers


def test_the_dry_run_says_a_job_does_not_fit_in_under_2_s_without_torch(tmp_path):
    model = tmp_path / "big"
    _config_too_big_for_this_host(model)
    runner = tmp_path / "run_cli.py"
    runner.write_text(RUNNER)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(runner), str(CLI), "--model", str(model), "--dry-run"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    seconds = time.perf_counter() - t0
    result = proc.stderr.strip().splitlines()[-1].split()
    assert result[:3] == ["RESULT", "1", "-"], proc.stdout + proc.stderr  # exit 1, nothing heavy imported
    assert "config.json (estimate)" in proc.stdout and "DOES NOT FIT" in proc.stdout, proc.stdout
    fits = proc.stdout.split("fits with: ")[1].splitlines()[0]
    assert fits.startswith(("--optimizer-state int8", "--lora-r 8", "--devices")), proc.stdout
    assert seconds < 2.0, f"--dry-run took {seconds:.2f} s"


def test_the_real_run_of_a_job_that_does_not_fit_is_refused_before_any_ledger(tmp_path):
    model = tmp_path / "big"
    _config_too_big_for_this_host(model)
    before = set(glob.glob("/dev/shm/slidedp-*"))
    proc = subprocess.run([str(CLI), "--model", str(model), "--optimizer-state", "fp32"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "the job's ledger needs" in line and ("add --" in line or "no flag of this command" in line), line
    assert set(glob.glob("/dev/shm/slidedp-*")) == before
    fix = line.split("add ")[1].split(", which fits")[0] if "add --" in line else None
    if fix is not None:  # the flag it names makes the plan fit
        args = Namespace(model=str(model), devices=2, optimizer_state="fp32", bf16_copy=True, precision="bf16-mixed",
                         param_route="full", lora_r=None, lora_alpha=None, lora_dropout=0.0, lora_targets=None)  # fmt: skip
        flags = fix.split()
        for flag, value in zip(flags, [*flags[1:], None], strict=True):
            if flag == "--optimizer-state":
                args.optimizer_state = value
            elif flag == "--no-bf16-copy":
                args.bf16_copy = False
            elif flag == "--lora-r":
                args.lora_r = int(value)
            elif flag == "--devices":
                args.devices = int(value)
        assert plan.of_flags(args).verdict == "fits", fix


def test_the_dry_run_predicts_the_step_on_a_hardware_profile(tmp_path):
    from slidedp_lightning.steptime import StepConfig, load_config, load_profile, simulate
    from slidedp_lightning_cli.finetune import main

    config = Path(plan.__file__).with_name("configs") / "qwen3_tiny.json"
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(config.read_text())
    argv = ["--model", str(tmp_path / "m"), "--devices", "1", "--batch-size", "4", "--seq-len", "512"]
    want = simulate(StepConfig(load_config(str(tmp_path / "m")), 4, 512, 1, activation="full", loss_sync=True),
                    load_profile("h200x1"))  # fmt: skip
    # the GPU host computes bf16 whether or not this one does: here it does not (a capped oneDNN: this host's own
    # default is FP32), and the prediction is still the bf16 job's
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    proc = subprocess.run([str(CLI), *argv, "--dry-run", "--hardware", "h200x1"], capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("  predicted on h200x1 (1 GPU, batch 4 x 512 tokens a GPU)"), proc.stdout
    assert f"step {want.step_time:.3f} s, {want.tokens_per_s:,.0f} tokens/s, {want.bottleneck}" in line, line
    with pytest.raises(SystemExit):
        main([*argv, "--dry-run", "--hardware", "no-such-profile"])


def test_the_dry_run_predicts_the_state_on_disk_with_the_profiles_disk(tmp_path, capsys):
    """--state-dir (--master-on-disk) reaches the prediction: a profile without the disk's rate is refused naming
    disk_gbps; with a slow one the disk bounds the step, longer with the master there too."""
    import json

    from slidedp_lightning.steptime.profiles import SHIPPED_PROFILES
    from slidedp_lightning_cli.finetune import main

    config = Path(plan.__file__).with_name("configs") / "qwen3_tiny.json"
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(config.read_text())
    (tmp_path / "state").mkdir()
    argv = ["--model", str(tmp_path / "m"), "--devices", "1", "--batch-size", "4", "--seq-len", "512", "--dry-run",
            "--precision", "bf16-mixed", "--state-dir", str(tmp_path / "state")]  # fmt: skip
    with pytest.raises(SystemExit):
        main([*argv, "--hardware", "h200x1"])
    assert "disk_gbps" in capsys.readouterr().err
    shipped = json.loads((SHIPPED_PROFILES / "h200x1.json").read_text())
    shipped["constants"]["disk_gbps"] = {"value": 1e-4, "source": "assumed: a slow disk"}
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(shipped))
    steps = []
    for extra in ([], ["--master-on-disk"]):
        main([*argv, *extra, "--hardware", str(slow)])
        line = capsys.readouterr().out.strip().splitlines()[-1]
        assert "host-bound (disk)" in line, line
        steps.append(float(line.split("step ")[1].split(" s")[0]))
    assert steps[1] > 1.4 * steps[0], steps  # 24 B/param over the disk instead of 16


def test_the_dry_run_refuses_a_profile_timed_in_another_precision(tmp_path, capsys):
    """A calibrated profile whose compute was timed in 32-true predicts 32-true jobs; a bf16-mixed job is refused,
    naming the calibration that fits it."""
    import json

    from slidedp_lightning.steptime.profiles import COMPUTE_PRECISION_KEY, SHIPPED_PROFILES
    from slidedp_lightning_cli.finetune import main

    config = Path(plan.__file__).with_name("configs") / "qwen3_tiny.json"
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(config.read_text())
    profile = json.loads((SHIPPED_PROFILES / "h200x1.json").read_text())
    profile["constants"][COMPUTE_PRECISION_KEY] = {"value": "32-true", "source": "probe: calibrate"}
    (tmp_path / "fp32.json").write_text(json.dumps(profile))
    argv = ["--model", str(tmp_path / "m"), "--devices", "1", "--batch-size", "4", "--seq-len", "512", "--dry-run",
            "--hardware", str(tmp_path / "fp32.json")]  # fmt: skip
    with pytest.raises(SystemExit):
        main([*argv, "--precision", "bf16-mixed"])
    err = capsys.readouterr().err
    assert "timed its compute in 32-true, this step runs bf16-mixed: calibrate with --precision bf16-mixed" in err, err
    main([*argv, "--precision", "32-true"])
    assert "step " in capsys.readouterr().out


def test_the_report_names_a_fix_only_for_a_job_that_needs_one():
    fits = plan.plan(plan.Model(params=GB // 10, counted="test"), plan.Setup(ranks=1), HOST)
    assert fits.verdict == "fits" and fits.as_dict()["fix"] is None
    big = plan.plan(plan.Model(params=int(1.5 * GB), counted="test"), plan.Setup(ranks=2), HOST)
    assert big.as_dict()["fix"] == "--optimizer-state int8" and big.as_dict()["verdict"] == "does not fit"
