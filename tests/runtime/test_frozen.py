"""Frozen parameters (requires_grad=False) under SlideDPEngine, one process, CPU: the rest trains exactly as torch's
AdamW with the same frozen set, the frozen weights stay bit-identical and no unit waits for their gradients."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from slidedp_lightning.runtime.activation_policy import ActivationPolicy
from slidedp_lightning.runtime.engine import EngineConfig, SlideDPEngine
from tests.helpers import rel_err, tiny_model, token_batches

CPU = torch.device("cpu")


def freeze_embeddings(model: nn.Module) -> None:
    model.model.embed_tokens.weight.requires_grad_(False)  # tied: the head is frozen with it


def freeze_middle_block(model: nn.Module) -> None:
    model.model.layers[1].requires_grad_(False)


def freeze_mix(model: nn.Module) -> None:
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    model.model.layers[2].mlp.requires_grad_(False)
    model.model.norm.weight.requires_grad_(False)


def trainable_groups(model: nn.Module) -> torch.optim.AdamW:
    """What users write: only the trainable parameters, with and without weight decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=3e-3,
        betas=(0.9, 0.95),
    )


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss


CASES: dict[str, tuple[Callable[[nn.Module], None], bool]] = {
    "embeddings": (freeze_embeddings, True),
    "middle_block": (freeze_middle_block, False),
    "mix": (freeze_mix, False),
}


@pytest.mark.parametrize(
    ("route", "update", "policy"),
    [
        ("gpu_reduce", "immediate", "none"),
        ("gpu_reduce", "deferred", "none"),
        ("host_reduce", "immediate", "none"),
        ("host_reduce", "deferred", "none"),
        ("gpu_reduce", "immediate", "full"),  # recomputed blocks
        ("host_reduce", "immediate", "selective@1"),  # offloaded activations
    ],
)
@pytest.mark.parametrize("case", list(CASES))
def test_frozen_matches_adamw(case: str, route: str, update: str, policy: str) -> None:
    freeze, tied = CASES[case]
    model = tiny_model(tied, layers=3)
    freeze(model)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen
    ref = copy.deepcopy(model)
    initial = {n: t.clone() for n, t in model.state_dict().items()}
    engine = SlideDPEngine(
        model,
        EngineConfig(grad_route=route, update=update, activation_policy=ActivationPolicy.coerce(policy)),
        device=CPU,
        compute_dtype=torch.float32,
    )
    try:
        assert {s.name for _, s in engine.layout.slots() if not s.trainable} == frozen
        engine.attach_optimizer(trainable_groups(model))
        ref_opt = trainable_groups(ref)
        for x in token_batches(6, 2, 16):
            loss = loss_of(model, x)
            loss.backward()
            assert engine.end_step()
            ref_opt.zero_grad()
            ref_loss = loss_of(ref, x)
            ref_loss.backward()
            ref_opt.step()
            assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
        assert engine.step == 6
        got, want = engine.state_dict(), ref.state_dict()
        assert got.keys() == want.keys()
        for name in want:
            if name in frozen:
                assert torch.equal(got[name], initial[name]), f"frozen {name} changed"
            else:
                assert rel_err(got[name], want[name]) <= 1e-5, name
        if case == "middle_block":  # a wholly frozen unit: never reduced nor updated
            unit = next(u for u in engine.layout.units if u.frozen)
            assert engine.ledger.version[unit.index].min() == 6  # stamped, so the next forward can fill it
            # no moments and, under FP32 compute, no BF16 copy: only the master the device reads
            for region in ("exp_avg", "exp_avg_sq", "bf16"):
                assert engine.ledger.region(region, unit.index) is None, region
            assert all(engine.state.moments(unit.index, i) is None for i in range(len(unit.slots)))
        for unit in engine.layout.units:  # units with a trainable parameter keep every region
            if not unit.frozen:
                assert all(engine.ledger.region(r, unit.index) is not None for r in ("master", "exp_avg", "bf16"))
    finally:
        engine.close()
    # parameters are restored to the module after training, frozen ones still frozen
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == frozen
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), got[name]), name


def test_trainable_parameter_missing_from_optimizer_still_refused() -> None:
    model = tiny_model(False, layers=3)
    freeze_middle_block(model)
    engine = SlideDPEngine(model, EngineConfig(), device=CPU, compute_dtype=torch.float32)
    try:
        params = [p for n, p in model.named_parameters() if p.requires_grad and "layers.2." not in n]
        with pytest.raises(ValueError, match="model.layers.2"):
            engine.attach_optimizer(torch.optim.AdamW(params))
        engine.attach_optimizer(torch.optim.AdamW(model.parameters()))  # frozen ones included: accepted too
    finally:
        engine.close()


def test_frozen_unit_reached_twice_per_step_and_accumulation() -> None:
    """Two backward passes per step (accumulate=2) with a wholly frozen block: it is released after each pass."""
    model = tiny_model(False, layers=3)
    freeze_middle_block(model)
    ref = copy.deepcopy(model)
    engine = SlideDPEngine(model, EngineConfig(accumulate=2), device=CPU, compute_dtype=torch.float32)
    try:
        engine.attach_optimizer(trainable_groups(model))
        ref_opt = trainable_groups(ref)
        xs = token_batches(8, 2, 16)
        for i in range(0, 8, 2):
            ref_opt.zero_grad()
            for x in xs[i : i + 2]:
                (loss_of(model, x) / 2).backward()
                (loss_of(ref, x) / 2).backward()
            assert engine.end_step()
            ref_opt.step()
            assert not any(engine.residency.held_for_backward)
        got, want = engine.state_dict(), ref.state_dict()
        for name in want:
            assert rel_err(got[name], want[name]) <= 1e-5, name
    finally:
        engine.close()


def test_optimizer_state_of_trainable_parameters_round_trips() -> None:
    """The optimizer state dict holds the trainable parameters only, as torch's AdamW (same frozen set) has it, and
    loads back; the frozen weights are in the model state dict."""
    model = tiny_model(False, layers=3)
    freeze_mix(model)
    ref = copy.deepcopy(model)
    engine = SlideDPEngine(model, EngineConfig(), device=CPU, compute_dtype=torch.float32)
    try:
        opt = trainable_groups(model)
        engine.attach_optimizer(opt)
        ref_opt = trainable_groups(ref)
        for x in token_batches(3, 2, 16):
            loss_of(model, x).backward()
            assert engine.end_step()
            ref_opt.zero_grad()
            loss_of(ref, x).backward()
            ref_opt.step()
        got, want = engine.optimizer_state_dict(opt), ref_opt.state_dict()
        assert got["state"].keys() == want["state"].keys()
        for i, s in want["state"].items():
            assert int(got["state"][i]["step"]) == int(s["step"])
            for k in ("exp_avg", "exp_avg_sq"):
                assert rel_err(got["state"][i][k], s[k]) <= 1e-5, (i, k)
        weights = engine.state_dict()
        assert model.model.norm.weight.requires_grad is False and "model.norm.weight" in weights
        engine.load_state_dict(weights)
        engine.load_optimizer_state_dict(opt, got)
        assert engine.step == 3
        x = token_batches(1, 2, 16, seed=5)[0]
        loss_of(model, x).backward()
        assert engine.end_step()
        ref_opt.zero_grad()
        loss_of(ref, x).backward()
        ref_opt.step()
        after, ref_after = engine.state_dict(), ref.state_dict()
        for name in ref_after:
            assert rel_err(after[name], ref_after[name]) <= 1e-5, name
        assert torch.equal(after["model.norm.weight"], weights["model.norm.weight"])
    finally:
        engine.close()


def test_bf16_copy_of_frozen_weights_untouched() -> None:
    """Under bf16 compute a wholly frozen unit keeps only its BF16 copy (no master, no moments): it stays the
    initial weights rounded to BF16, which is what the state dict reports for it."""
    model = tiny_model(False, layers=3)
    freeze_middle_block(model)
    initial = {n: t.clone() for n, t in model.state_dict().items()}
    engine = SlideDPEngine(model, EngineConfig(), device=CPU, compute_dtype=torch.bfloat16)
    try:
        engine.attach_optimizer(trainable_groups(model))
        for x in token_batches(3, 2, 16):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_of(model, x)
            loss.backward()
            assert engine.end_step()
        unit = next(u for u in engine.layout.units if u.frozen)
        for region in ("master", "exp_avg", "exp_avg_sq"):
            assert engine.ledger.region(region, unit.index) is None, region
        bf16 = engine.ledger.region("bf16", unit.index)
        assert bf16 is not None
        for slot in unit.slots:
            want = initial[slot.name].reshape(-1).to(torch.bfloat16)
            assert torch.equal(bf16[slot.offset : slot.end], want), slot.name
        for a, b in unit.gaps():
            assert not bf16[a:b].any()
        weights = engine.state_dict()
        for name in initial:
            if name.startswith("model.layers.1."):
                assert torch.equal(weights[name], initial[name].to(torch.bfloat16).float()), name
            elif name.endswith("weight") and "norm" not in name:
                assert not torch.equal(weights[name], initial[name]), f"{name} did not train"
    finally:
        engine.close()
