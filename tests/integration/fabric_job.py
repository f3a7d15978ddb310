"""One Lightning Fabric training job for tests/test_fabric.py: ``python fabric_job.py CONFIG.json``.

A LitGPT-style Fabric loop (the optimizer and an LR schedule made before ``fabric.setup``, ``fabric.backward``,
``fabric.clip_gradients``, ``optimizer.step()``, ``fabric.save``/``fabric.load``) on ``litgpt.model.GPT`` or
``tests.helpers.NanoGPT``, under ``strategy`` ("slidedp" or "ddp"). CONFIG.json keys: see :data:`DEFAULTS`. Writes
``losses_rank{r}.json`` (the steps this run made) and ``final_state.pt`` (rank 0: the FP32 weights) into ``out``.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn

import slidedp_lightning  # noqa: F401  (registers Fabric(strategy="slidedp"))

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the tests package importable
from tests import helpers  # noqa: E402

VOCAB, SEQ, BATCH = 64, 16, 2
DEFAULTS = {
    "out": "",
    "strategy": "slidedp",
    "model": "nanogpt",  # or "litgpt"
    "devices": 2,
    "precision": "32-true",
    "steps": 20,
    "clip": 1.0,  # fabric.clip_gradients(max_norm=...) every step; 0: none
    "save_at": 0,  # after this many steps: fabric.save(ckpt, state)
    "ckpt": "",
    "resume": "",  # fabric.load(resume, state) before the first step
}


def build(name: str) -> nn.Module:
    if name == "litgpt":
        from litgpt.config import Config
        from litgpt.model import GPT

        shape = dict(n_layer=2, n_embd=32, n_head=4, head_size=8, n_query_groups=2, intermediate_size=64)
        return GPT(Config.from_name("Llama-3.2-1B", vocab_size=VOCAB, padded_vocab_size=VOCAB, block_size=SEQ, **shape))
    return helpers.NanoGPT(vocab=VOCAB, max_positions=SEQ)


def lm_loss(model: nn.Module, x: torch.Tensor, name: str) -> torch.Tensor:
    if name == "nanogpt":
        return model(x, x)[1]
    logits = model(x)
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())


def main(cfg: dict) -> None:
    fabric = L.Fabric(strategy=cfg["strategy"], accelerator="cpu", devices=cfg["devices"], precision=cfg["precision"])
    fabric.launch()
    fabric.seed_everything(0)
    with fabric.init_module():
        model = build(cfg["model"])
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))
    model, optimizer = fabric.setup(model, optimizer)  # the optimizer holds the parameters from before setup
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if cfg["resume"]:
        fabric.load(cfg["resume"], state)
    batches = helpers.token_batches(cfg["steps"] * fabric.world_size, BATCH, SEQ, vocab=VOCAB)
    losses = []
    for step in range(state["step"], cfg["steps"]):
        x = batches[step * fabric.world_size + fabric.global_rank]
        loss = lm_loss(model, x, cfg["model"])
        fabric.backward(loss)
        if cfg["clip"]:
            fabric.clip_gradients(model, optimizer, max_norm=cfg["clip"])
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
        state["step"] = step + 1
        if step + 1 == cfg["save_at"]:
            fabric.save(cfg["ckpt"], state)
    out = Path(cfg["out"])
    (out / f"losses_rank{fabric.global_rank}.json").write_text(json.dumps(losses))
    strategy = fabric.strategy
    if cfg["strategy"] == "slidedp":
        weights = strategy.engine.state_dict() if fabric.global_rank == 0 else {}
        strategy.teardown()
    else:
        weights = model.module.state_dict()
    if fabric.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in weights.items()}, out / "final_state.pt")


def run(path: str) -> None:
    """The job of the configuration file ``path`` (its keys over :data:`DEFAULTS`)."""
    main({**DEFAULTS, **json.loads(Path(path).read_text())})


if __name__ == "__main__":
    run(sys.argv[1])
    gc.freeze()  # exit without collecting the heap again (see slidedp_lightning_cli.finetune.cli)
