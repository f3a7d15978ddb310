"""Shared helpers of the Lightning-level tests: a tiny LightningModule, its data and a one-process Trainer."""

from __future__ import annotations

import glob
import warnings

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from tests.helpers import VOCAB, tiny_model


def adamw(params, lr: float = 3e-3):
    params = list(params)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95)
    )


class TinyLM(L.LightningModule):
    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.model = tiny_model()
        self.losses: list[float] = []
        self.batches: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.batches.append(batch.detach().clone())
        self.param_dtypes = {p.dtype for p in self.parameters()}
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return adamw(self.parameters())


def data(n: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(torch.randint(0, VOCAB, (n, 12), generator=g), batch_size=2)


def trainer(**kw) -> L.Trainer:
    kw.setdefault("strategy", "slidedp")
    kw.setdefault("max_steps", 1)
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def slidedp_shm() -> set[str]:
    return set(glob.glob("/dev/shm/slidedp-*"))


@pytest.fixture(autouse=True)
def quiet_and_clean():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
