"""LoRA through peft under SlideDPEngine, one process, CPU: the blocks are found through the peft wrapper, the
adapters train exactly as torch's AdamW on the same model, the base stays bit-identical, and the adapters the
engine trained are what ``PeftModel.save_pretrained`` writes after training."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from slidedp_lightning.runtime.engine import EngineConfig, SlideDPEngine
from tests.helpers import rel_err, tiny_model, token_batches

peft = pytest.importorskip("peft")

CPU = torch.device("cpu")


def lora_model(modules_to_save: list[str] | None = None) -> torch.nn.Module:
    torch.manual_seed(3)
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
        lora_dropout=0.0,
        init_lora_weights=False,  # random B: the adapters change the loss from the first step
        modules_to_save=modules_to_save,
    )
    return peft.get_peft_model(tiny_model(False, layers=3), config)


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("modules_to_save", [None, ["lm_head"]], ids=["adapters", "adapters+head"])
def test_lora_trains_like_adamw_and_saves_adapters(tmp_path: Path, modules_to_save: list[str] | None) -> None:
    model = lora_model(modules_to_save)
    ref = copy.deepcopy(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "modules_to_save" in n for n in trainable)
    initial = {n: t.clone() for n, t in model.state_dict().items()}
    engine = SlideDPEngine(model, EngineConfig(), device=CPU, compute_dtype=torch.float32)
    try:
        assert engine.model is model.base_model.model  # the transformers model inside the peft wrapper
        assert [u.name for u in engine.layout.units] == ["embed", "layers.0", "layers.1", "layers.2", "head"]
        assert engine.layout.units[0].frozen and all(u.has_frozen for u in engine.layout.units)
        engine.attach_optimizer(adamw(model))
        ref_opt = adamw(ref)
        for x in token_batches(5, 2, 16):
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            assert engine.end_step()
            ref_opt.zero_grad()
            ref_loss = ref(input_ids=x, labels=x).loss
            ref_loss.backward()
            ref_opt.step()
            assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
        got, want = engine.state_dict(), ref.state_dict()
    finally:
        engine.close()
    assert got.keys() == want.keys()
    for name in want:
        if name in trainable:
            assert not torch.equal(got[name], initial[name]), f"adapter {name} did not train"
            assert rel_err(got[name], want[name]) <= 1e-5, name
        else:
            assert torch.equal(got[name], initial[name]), f"frozen {name} changed"
    # after fit the module holds the trained parameters again (frozen ones still frozen): peft saves the adapters
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
    model.save_pretrained(tmp_path)
    saved = peft.utils.load_peft_weights(str(tmp_path))
    assert saved and all("lora_" in k or "lm_head" in k for k in saved)
    loaded = peft.PeftModel.from_pretrained(tiny_model(False, layers=3), tmp_path)
    x = token_batches(1, 2, 16, seed=9)[0]
    with torch.no_grad():
        assert rel_err(loaded(input_ids=x).logits, ref(input_ids=x).logits) <= 1e-5
