"""Shipped profiles: every constant sourced, rates derived correctly, bad input refused."""

import json

import pytest

from slidedp_lightning.steptime.graph import StepConfig
from slidedp_lightning.steptime.profiles import GB, SOURCE_KINDS, Profile, load_profile, shipped_profiles
from slidedp_lightning.steptime.simulate import simulate
from slidedp_lightning.steptime.workload import load_config


def test_shipped_profiles_have_sources():
    names = shipped_profiles()
    assert set(names) == {"rtx4090x4", "a800x8_bridge", "a800x8_nobridge", "h100x8", "h200x1", "h200x1_vm16"}
    for name in names:
        p = load_profile(name)
        assert all(p.sources[k].startswith(SOURCE_KINDS) for k in p.values)


@pytest.mark.parametrize(
    "model, batch, activation, optimizer_state, measured_s",
    [
        ("qwen3-1.7b", 8, "none", "fp32", 0.7287),  # fitted to (compute, update)
        ("qwen3-1.7b", 32, "full", "fp32", 1.3706),  # fitted to (compute)
        ("qwen3-8b", 32, "full", "int8", 4.3978),  # out of sample
    ],
)
def test_the_measured_h200_profile_predicts_its_runs_within_20_percent(
    model, batch, activation, optimizer_state, measured_s
):
    """The step times bench/gpu_check.py measured on one H200 (docs/PERFORMANCE.md, "One H200")."""
    cfg = StepConfig(load_config(model), batch, 1024, 1, activation=activation, optimizer_state=optimizer_state)
    predicted = simulate(cfg, load_profile("h200x1_vm16")).step_time
    assert predicted == pytest.approx(measured_s, rel=0.2)


def test_paper_constants():
    p = load_profile("a800x8_bridge")
    assert p.h2d_per_gpu(1) == 15.6 * GB and p.h2d_per_gpu(2) == 8.7 * GB
    assert p.h2d_per_gpu(8) == 8.7 * GB  # pairs behind their own switches
    # CPU Adam: ~183 GB/s on 16 cores, +8.5-10 % on 32, and little more beyond (saturation)
    assert p.update_rate(16) == pytest.approx(183e9, rel=1e-6)
    assert p.update_rate(32) / p.update_rate(16) == pytest.approx(1.0925, abs=0.01)
    assert p.update_rate(64) / p.update_rate(32) < 1.06


def test_capacities_share_the_host():
    p = load_profile("a800x8_bridge")
    c4, c8 = p.capacities(4), p.capacities(8)
    assert c8["cpu"] == pytest.approx(c4["cpu"] / 2) and c8["dram"] == pytest.approx(c4["dram"] / 2)


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="unknown hardware profile 'tpu'"):
        load_profile("tpu")
    with pytest.raises(ValueError, match="has 4 GPU"):
        load_profile("rtx4090x4").capacities(5)
    with pytest.raises(ValueError, match=">= 1"):
        load_profile("h200x1").capacities(0)
    data = load_profile("h200x1").to_json()
    data["constants"]["gpu_flops"]["source"] = "a guess"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="gpu_flops"):
        load_profile(bad)
    del data["constants"]["gpu_flops"]
    with pytest.raises(ValueError, match="missing constants"):
        Profile.from_json(data)


def test_roundtrip(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(load_profile("h100x8").to_json()))
    assert load_profile(path).values == load_profile("h100x8").values


def test_a_profile_timed_in_one_precision_predicts_steps_of_that_precision_only():
    """A calibrated CPU profile says which precision its compute was timed in; a step of another precision is
    refused with the calibration that fits it (a CPU computes BF16 and FP32 at different rates)."""
    from dataclasses import replace

    from slidedp_lightning.steptime.profiles import COMPUTE_PRECISION_KEY

    shipped = load_profile("h200x1")
    step = StepConfig(load_config("qwen3-tiny"), 8, 256, 1, "full")
    assert step.precision == "bf16-mixed" and COMPUTE_PRECISION_KEY not in shipped.values
    assert simulate(step, shipped).step_time > 0  # a profile without the key predicts every precision
    fp32 = Profile(shipped.name, {**shipped.values, COMPUTE_PRECISION_KEY: "32-true"}, shipped.sources)
    with pytest.raises(ValueError, match="timed its compute in 32-true, this step runs bf16-mixed: calibrate with "
                       "--precision bf16-mixed"):  # fmt: skip
        simulate(step, fp32)
    assert simulate(replace(step, precision="32-true"), fp32).step_time == pytest.approx(
        simulate(replace(step, precision="32-true"), shipped).step_time
    )


def test_build_profile_records_the_precision_its_compute_was_timed_in():
    from slidedp_lightning.steptime.calibrate import build_profile
    from slidedp_lightning.steptime.profiles import COMPUTE_PRECISION_KEY

    raw = {"gpu_flops": 5e10, "op_overhead_s": 1e-4, "bwd_fwd_ratio": 2.0, "step_overhead_s": 0.0, "copy_lat": 0.0,
           "copy_rate": 2e10, "link_lat": 3e-4, "link_rate": 5e8, "upd_rate": 5e10}  # fmt: skip
    assert build_profile(raw, 2, "qwen3-tiny", 26).compute_precision == "32-true"  # what calibrate always timed
    bf16 = build_profile({**raw, COMPUTE_PRECISION_KEY: "bf16-mixed"}, 2, "qwen3-tiny", 26)
    assert bf16.compute_precision == "bf16-mixed" and "timed in bf16-mixed" in bf16.sources[COMPUTE_PRECISION_KEY]
    assert bf16.sources[COMPUTE_PRECISION_KEY].startswith("probe:")
