"""Shared helpers of the model tests: train a model through the engine beside torch AdamW."""

from __future__ import annotations

import copy

import torch
from torch import nn

from slidedp_lightning.runtime.engine import EngineConfig, SlideDPEngine
from tests.helpers import rel_err


def adamw(model: nn.Module) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95)
    )


def assert_rel_close(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys()
    for k in expected:
        err = rel_err(actual[k], expected[k])
        assert err <= 1e-5, f"{what} {k}: relative error {err:.3g}"


def train_and_compare(
    model: nn.Module, loss_fn, inputs: list, steps: int = 2, config: EngineConfig | None = None
) -> None:
    """Train ``model`` through SlideDPEngine and a deep copy with torch AdamW; losses, weights and moments agree.

    After each compared step the reference restarts from the engine's weights and moments: the CPU kernel may
    round the last bit differently from torch, and over several steps Adam amplifies such one-ulp differences on
    elements whose gradients are near eps (Qwen2's k_proj biases). Each step's update is still checked at 1e-5
    from one common state; the free-running trajectory of Qwen3 is checked in tests/runtime/test_engine.py.
    """
    ref = copy.deepcopy(model)
    trained = {n for n, _ in model.named_parameters(remove_duplicate=False)}  # persistent buffers stay as they are
    initial = {k: v.detach().clone() for k, v in model.state_dict().items() if k in trained}
    engine = SlideDPEngine(model, config or EngineConfig(), device=torch.device("cpu"), compute_dtype=torch.float32)
    try:
        opt = adamw(model)
        engine.attach_optimizer(opt)
        ref_opt = adamw(ref)
        for step, x in enumerate(inputs[:steps], 1):
            loss = loss_fn(model, x)
            loss.backward()
            assert engine.end_step()
            ref_opt.zero_grad()
            ref_loss = loss_fn(ref, x)
            ref_loss.backward()
            ref_opt.step()
            assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
            assert_rel_close(engine.state_dict(), ref.state_dict(), f"step {step} weight")
            ours, theirs = engine.optimizer_state_dict(opt)["state"], ref_opt.state_dict()["state"]
            assert ours.keys() == theirs.keys() and len(theirs) == len(list(model.parameters()))
            for i in theirs:
                assert float(ours[i]["step"]) == float(theirs[i]["step"]) == step
                for k in ("exp_avg", "exp_avg_sq"):
                    assert_rel_close({i: ours[i][k]}, {i: theirs[i][k]}, f"step {step} {k}")
            ref.load_state_dict(engine.state_dict())
            ref_opt.load_state_dict(engine.optimizer_state_dict(opt))
        final = engine.state_dict()
        still = [k for k, v in initial.items() if torch.equal(final[k], v)]
        assert not still, f"parameters never updated: {still}"
    finally:
        engine.close()


def lm_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss
