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
