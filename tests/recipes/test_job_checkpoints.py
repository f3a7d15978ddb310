"""The job's step checkpoints: every N steps and always the last one, the newest K kept."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from slidedp_lightning.recipes.job import StepCheckpoint


@pytest.mark.parametrize(
    ("every", "max_steps", "keep", "saved"),
    [(2, 5, 5, ["step=2.ckpt", "step=4.ckpt", "step=5.ckpt"]), (3, 6, 5, ["step=3.ckpt", "step=6.ckpt"]),
     (2, 5, 2, ["step=4.ckpt", "step=5.ckpt"]), (4, 7, 2, ["step=4.ckpt", "step=7.ckpt"])],
)  # fmt: skip
def test_the_last_step_is_saved_when_the_interval_does_not_reach_it(tmp_path, every, max_steps, keep, saved) -> None:
    torch.manual_seed(0)
    checkpoint = StepCheckpoint(
        last_step=max_steps, dirpath=tmp_path, filename="step={step}", auto_insert_metric_name=False,
        every_n_train_steps=every, save_top_k=keep, monitor="step", mode="max",
    )  # fmt: skip
    trainer = L.Trainer(
        max_steps=max_steps, callbacks=[checkpoint], logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, accelerator="cpu", devices=1,
    )  # fmt: skip
    trainer.fit(BoringModel())
    assert sorted(p.name for p in tmp_path.iterdir()) == saved
    assert torch.load(tmp_path / saved[-1], weights_only=False)["global_step"] == max_steps
