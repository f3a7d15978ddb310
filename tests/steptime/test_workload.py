"""Units, parameter counts and FLOPs from transformers configs."""

import json

import pytest

from slidedp_lightning.steptime.workload import UnitActivation, activation_policy, load_config, units


def test_qwen3_14b_and_8b_parameter_counts():
    # public totals: Qwen3-14B 14.8 B, Qwen3-8B 8.2 B parameters
    assert load_config("qwen3-14b").total_params == pytest.approx(14.77e9, rel=0.01)
    assert load_config("qwen3-8b").total_params == pytest.approx(8.19e9, rel=0.01)


def test_tiny_matches_the_torch_model():
    from transformers import AutoModelForCausalLM, Qwen3Config

    shape = load_config("qwen3-tiny")
    data = json.loads(open("slidedp_lightning/recipes/configs/qwen3_tiny.json").read())
    data.pop("attn_implementation")
    model = AutoModelForCausalLM.from_config(Qwen3Config.from_dict(data))
    assert shape.tied and shape.total_params == sum(p.numel() for p in model.parameters())
    assert shape.layer_params == sum(p.numel() for p in model.model.layers[0].parameters())


def test_units_flops_and_tied_head():
    shape = load_config("qwen3-tiny")
    us = units(shape, seq=26)
    assert [u.name for u in us] == ["embed", "layer0", "layer1", "layer2", "layer3", "head"]
    assert us[-1].borrows == (0,) and us[0].fwd_flops_per_token == 0
    assert us[1].fwd_flops_per_token > 2 * shape.layer_matmul_params()  # plus attention
    untied = units(load_config("qwen3-14b"), seq=1024)
    assert untied[-1].borrows == () and untied[-1].params == 151936 * 5120 + 5120


def test_activation_policies():
    shape = load_config("qwen3-8b")
    assert activation_policy("full", shape).recompute_fraction == 1.0
    assert (
        activation_policy("none", shape).retained_bytes_per_token
        > activation_policy("full", shape).retained_bytes_per_token
    )
    plans = [UnitActivation(0.5, 10.0, 0.25)] * shape.layers
    assert units(shape, 8, plans)[1].activation.offload_ratio == 0.25
    with pytest.raises(ValueError, match="unknown activation policy"):
        activation_policy("segments", shape)
    with pytest.raises(ValueError, match="activation plans"):
        units(shape, 8, plans[:3])
    with pytest.raises(ValueError, match=r"offload_ratio must be in \[0, 1\]"):
        UnitActivation(0.0, 1.0, 1.5)


def test_bad_configs(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_config(tmp_path / "missing.json")
    moe = tmp_path / "moe.json"
    moe.write_text(
        json.dumps(
            {
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 1,
                "vocab_size": 8,
                "num_experts": 128,
            }
        )
    )
    with pytest.raises(ValueError, match="mixture-of-experts"):
        load_config(moe)
    with pytest.raises(ValueError, match="not a decoder-only"):
        load_config({"hidden_size": 8})
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(moe.read_text().replace(', "num_experts": 128', ""))
    assert load_config(tmp_path / "ckpt").hidden == 8
