"""Compact optimizer state, one process, CPU: int8 moments (``optimizer_state="int8"``) and no BF16 copy
(``bf16_copy=False``): their ledger size, training close to (int8) or exactly as (no BF16 copy) the default
ledger, their state views and checkpoints, and the option rules."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

import cpu_ops.adamw8
from slidedp_lightning import constants
from slidedp_lightning.checkpoints import distributed as checkpoint
from slidedp_lightning.checkpoints.files import content_digest
from slidedp_lightning.options import SlideDPOptions
from slidedp_lightning.runtime.engine import EngineConfig, SlideDPEngine
from tests.helpers import rel_err, tiny_model, token_batches
from tests.runtime.helpers import aligned_model

CPU = torch.device("cpu")


def run(config: EngineConfig, dtype: torch.dtype = torch.float32, steps: int = 6, ck: Path | None = None):
    """``steps`` steps of the tiny model; returns (losses, state dict, optimizer state dict, engine stats)."""
    model = tiny_model(False, layers=3)
    engine = SlideDPEngine(model, config, device=CPU, compute_dtype=dtype)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
        engine.attach_optimizer(opt)
        losses = []
        for i, x in enumerate(token_batches(steps, 2, 16)):
            if ck is not None and i == steps // 2:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # DCP without a process group
                    checkpoint.save(engine, {"state_dict": {}}, ck)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            assert engine.end_step()
            losses.append(loss.item())
        return losses, engine.state_dict(), engine.optimizer_state_dict(opt), engine.ledger_stats()
    finally:
        engine.close(restore=False)


def test_the_constants_name_the_kernels_block() -> None:
    assert constants.QUANT_BLOCK == cpu_ops.adamw8.QUANT_BLOCK
    assert constants.ledger_bytes_per_param() == constants.LEDGER_BYTES_PER_PARAM == 14
    assert constants.ledger_bytes_per_param("int8") == pytest.approx(8 + 8 / constants.QUANT_BLOCK)
    assert constants.ledger_bytes_per_param("int8", bf16_copy=False) == pytest.approx(6 + 8 / constants.QUANT_BLOCK)
    assert constants.update_bytes_per_param(4) == 28  # the default convention, unchanged


@pytest.mark.parametrize(
    ("mode", "bound"),
    [
        ({"optimizer_state": "int8"}, 8.2),
        ({"optimizer_state": "int8", "bf16_copy": False}, 6.2),
        ({"bf16_copy": False}, 12.2),
    ],
)
def test_compact_ledgers_bytes_per_param(mode: dict, bound: float) -> None:
    engine = SlideDPEngine(aligned_model(layers=4), EngineConfig(**mode), device=CPU, compute_dtype=torch.bfloat16)
    try:
        stats = engine.ledger_stats()
        assert stats.padded_params <= 1.001 * stats.num_params, "the test model is meant to have little padding"
        assert stats.bytes_per_param <= bound, stats
        want = constants.ledger_bytes_per_param(mode.get("optimizer_state", "fp32"), mode.get("bf16_copy", True))
        assert stats.trainable_bytes == pytest.approx(want * stats.padded_params)
        if not mode.get("bf16_copy", True):
            assert all(engine.ledger.region("bf16", u.index) is None for u in engine.layout.units)
    finally:
        engine.close(restore=False)


def test_no_bf16_copy_is_exact() -> None:
    """FP32 compute never reads the BF16 copy; bf16 compute converts the master on the way with the update kernel's
    rounding, on the host (staging) or after the copy: the same bits either way."""
    assert _same(run(EngineConfig(bf16_copy=False)), run(EngineConfig()))
    ref = run(EngineConfig(), torch.bfloat16)
    for convert in ("host", "device"):
        assert _same(run(EngineConfig(bf16_copy=False, h2d_convert=convert), torch.bfloat16), ref), convert


def _same(a, b) -> bool:
    return a[0] == b[0] and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


@pytest.mark.parametrize("knobs", [{}, {"update": "deferred"}, {"accumulate": 2}, {"chunk_bytes": 4096}])
def test_int8_trains_close_to_exact(knobs: dict) -> None:
    exact = run(EngineConfig(**knobs), steps=8)
    got = run(EngineConfig(optimizer_state="int8", **knobs), steps=8)
    assert got[0][-1] < got[0][0]  # it trains
    for a, b in zip(got[0], exact[0]):
        assert abs(a - b) <= 0.02 * abs(b)
    init = tiny_model(False, layers=3).state_dict()
    moved = torch.cat([(exact[1][k] - init[k]).reshape(-1) for k in init]).abs().median()
    off = torch.cat([(got[1][k] - exact[1][k]).reshape(-1) for k in init]).abs().median()
    # loose: 8-bit moments, not equality (the typical element; a few elements whose exp_avg_sq falls below the
    # map's range in their block take far larger steps, see docs/ledger.md, "Compact modes")
    assert off <= 0.5 * moved, (off, moved)


def test_int8_optimizer_state_dict_dequantizes() -> None:
    """After one step (the same gradients in both runs) the dequantized moments are the exact ones to 8 bits."""
    exact, got = run(EngineConfig(), steps=1), run(EngineConfig(optimizer_state="int8"), steps=1)
    assert got[2]["state"].keys() == exact[2]["state"].keys()
    for i, s in exact[2]["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert got[2]["state"][i][k].dtype == torch.float32
            assert rel_err(got[2]["state"][i][k], s[k]) <= 0.05, (i, k)


def test_int8_checkpoint_resumes_bit_exact_and_another_mode_is_refused(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    straight = run(EngineConfig(optimizer_state="int8"), steps=6, ck=ck)
    info = checkpoint.read_meta(ck)["slidedp"]
    assert info["optimizer_state"] == "int8" and info["bf16_copy"] is True
    model = tiny_model(False, seed=5, layers=3)
    for mode, error in (("fp32", "optimizer_state='int8'"), ("int8", None)):
        model = tiny_model(False, seed=5, layers=3)
        engine = SlideDPEngine(model, EngineConfig(optimizer_state=mode), device=CPU, compute_dtype=torch.float32)
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
            engine.attach_optimizer(opt)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if error is not None:
                    with pytest.raises(ValueError, match=r"optimizer_state='int8'.*optimizer_state='fp32'"):
                        checkpoint.load(engine, ck)
                    continue
                checkpoint.load(engine, ck)
            losses = []
            for x in token_batches(6, 2, 16)[3:]:
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
                assert engine.end_step()
                losses.append(loss.item())
            assert losses == straight[0][3:]
            got = engine.state_dict()
            assert all(torch.equal(got[k], straight[1][k]) for k in got)
        finally:
            engine.close(restore=False)


def test_int8_optimizer_state_dict_round_trips() -> None:
    model = tiny_model(False, layers=3)
    engine = SlideDPEngine(model, EngineConfig(optimizer_state="int8"), device=CPU, compute_dtype=torch.float32)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        engine.attach_optimizer(opt)
        for x in token_batches(2, 2, 16):
            model(input_ids=x, labels=x).loss.backward()
            assert engine.end_step()
        state = engine.optimizer_state_dict(opt)
        engine.load_optimizer_state_dict(opt, state)  # quantized again: the same codes and scales
        again = engine.optimizer_state_dict(opt)
        for i, s in state["state"].items():
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(again["state"][i][k], s[k]), (i, k)
    finally:
        engine.close(restore=False)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"optimizer_state": "int4"}, "optimizer_state must be one of"),
        ({"bf16_copy": "no"}, "bf16_copy must be True or False"),
        ({"optimizer_state": "int8", "checkpoint_format": "full"}, "checkpoint_format='distributed'"),
        (
            {"optimizer_state": "int8", "chunk_bytes": 2 * constants.QUANT_BLOCK},
            f"chunk_bytes must be at least {4 * constants.QUANT_BLOCK}",
        ),
    ],
)
def test_bad_combinations_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SlideDPOptions(**kwargs)


def test_options_reach_the_engine_config() -> None:
    cfg = SlideDPOptions(optimizer_state="int8", bf16_copy=False, chunk_bytes=5000).base_engine_config()
    assert (cfg.optimizer_state, cfg.bf16_copy) == ("int8", False)
    assert cfg.chunk_elems is not None and cfg.chunk_elems % constants.QUANT_BLOCK == 0
    assert SlideDPOptions(chunk_bytes=5000).base_engine_config().chunk_elems == 5000 // 4 // 16 * 16


@pytest.mark.parametrize("bf16_copy", [True, False])
def test_int8_with_frozen_parameters(bf16_copy: bool) -> None:
    """A wholly frozen block (no moments, no scales) and a frozen parameter inside a trained unit (laid out after the
    trainable ones, beyond the unit's codes and scales; its BF16 copy is its only copy when kept): frozen weights
    stay, the rest trains."""
    model = tiny_model(False, layers=3)
    model.model.layers[1].requires_grad_(False)
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    initial = {n: t.clone() for n, t in model.state_dict().items()}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    config = EngineConfig(optimizer_state="int8", bf16_copy=bf16_copy)
    engine = SlideDPEngine(model, config, device=CPU, compute_dtype=torch.bfloat16)
    try:
        unit = next(u for u in engine.layout.units if u.frozen)
        for region in ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"):
            assert engine.ledger.region(region, unit.index) is None, region
        assert (engine.ledger.region("bf16", unit.index) is not None) == bf16_copy
        block0 = next(u for u in engine.layout.units if u.has_frozen and not u.frozen)
        assert block0.slots[-1].name.endswith("q_proj.weight") and block0.trainable_extent < block0.padded
        for region in ("exp_avg", "exp_avg_sq"):
            assert engine.ledger.extent(region, block0.index) == block0.trainable_extent
        assert engine.ledger.extent("master", block0.index) == (block0.trainable_extent if bf16_copy else block0.padded)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
        engine.attach_optimizer(opt)
        losses = []
        for x in token_batches(6, 2, 16):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            assert engine.end_step()
            losses.append(loss.item())
        assert losses[-1] < losses[0]
        weights = engine.state_dict()
        for name in initial:
            if name in frozen:
                want = initial[name].to(torch.bfloat16).float() if bf16_copy else initial[name]
                assert torch.equal(weights[name], want), name
            elif name.endswith("proj.weight"):
                assert not torch.equal(weights[name], initial[name]), f"{name} did not train"
        assert len(engine.optimizer_state_dict(opt)["state"]) == len(opt.param_groups[0]["params"])
    finally:
        engine.close(restore=False)


@pytest.mark.parametrize(
    "recorded", [None, "dynamic-tree", "int8-e4m3"], ids=["unrecorded", "dynamic-tree", "linear-int8"]
)
def test_int8_moments_of_another_code_are_refused_naming_both(tmp_path: Path, recorded: str | None) -> None:
    """A checkpoint's int8 codes are read only by the code that wrote them (``cpu_ops.adamw8.MOMENT_FORMAT``,
    recorded in meta.json): re-encoding them in another code would not be exact. One of the earlier dynamic-tree
    code, which records none, and one of the linear int8 code are refused by name."""
    ck = tmp_path / "ck"
    run(EngineConfig(optimizer_state="int8"), steps=2, ck=ck)
    meta_file = ck / "meta.json"
    meta = json.loads(meta_file.read_text())
    assert meta["slidedp"]["moment_format"] == cpu_ops.adamw8.MOMENT_FORMAT
    if recorded is None:
        del meta["slidedp"]["moment_format"]
    else:
        meta["slidedp"]["moment_format"] = recorded
    meta["slidedp"]["meta_xxh3"] = content_digest(meta)  # as the release that wrote it would have
    meta_file.write_text(json.dumps(meta))
    model = tiny_model(False, seed=5, layers=3)
    engine = SlideDPEngine(model, EngineConfig(optimizer_state="int8"), device=CPU, compute_dtype=torch.float32)
    try:
        engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(
                ValueError,
                match=rf"'{recorded or 'dynamic-tree'}' code, and this release reads '{cpu_ops.adamw8.MOMENT_FORMAT}'",
            ):
                checkpoint.load(engine, ck)
    finally:
        engine.close(restore=False)
