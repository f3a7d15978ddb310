"""A small 2-rank SlideDP job for the reliability tests and the exit soak: ``python reliability_job.py CONFIG.json``.

CONFIG.json (every key optional): ``out`` (folder for the per-rank records), ``devices`` (2), ``steps`` (3),
``strategy`` (SlideDPStrategy keyword arguments), ``refit`` (after fit, ``"validate"`` or ``"fit"`` again in the same
processes), ``last_collective`` (an all-reduce and a barrier in ``on_train_end``, right before teardown),
``stop_rank``/``stop_at_step`` (that rank SIGSTOPs itself in that training step), ``signal_rank``/
``signal_at_step``/``signal`` (that rank sends itself the signal, e.g. ``"SIGTERM"``), ``pg_timeout`` (s),
``keep_groups`` (leave the process groups alive at teardown, as before the strategy destroyed them: the exit soak's
comparison, experiments/soak_exit.py).

Per rank it writes ``threads_rank{r}.json`` (the native thread names before the first Trainer and after each
Trainer call), ``pid_rank{r}`` at the start of training and ``done_rank{r}`` as its very last statement.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from slidedp_lightning import SlideDPStrategy  # noqa: E402
from tests.helpers import Tokens, tiny_model  # noqa: E402

VOCAB, SEQ = 64, 16


def thread_names() -> list[str]:
    """The names (``comm``) of this process's native threads."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return sorted(names)


class LM(L.LightningModule):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = tiny_model(vocab=VOCAB, max_positions=SEQ)

    def on_train_start(self) -> None:
        with open(os.path.join(self.cfg["out"], f"pid_rank{self.global_rank}"), "w") as f:
            f.write(str(os.getpid()))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        cfg = self.cfg
        if batch_idx == cfg.get("stop_at_step") and self.global_rank == cfg.get("stop_rank"):
            os.kill(os.getpid(), signal.SIGSTOP)
        if batch_idx == cfg.get("signal_at_step") and self.global_rank == cfg.get("signal_rank"):
            os.kill(os.getpid(), getattr(signal, cfg.get("signal", "SIGTERM")))
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def on_train_end(self) -> None:
        if self.cfg.get("last_collective"):  # the last collectives of the run, right before the strategy's teardown
            total = self.trainer.strategy.reduce(torch.ones(1), reduce_op="sum")
            assert total.item() == self.trainer.world_size, total
            self.trainer.strategy.barrier()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loader(cfg: dict) -> DataLoader:
    n = cfg.get("steps", 3) * 2 * cfg.get("devices", 2)
    return DataLoader(Tokens(n, seed=3, vocab=VOCAB, seq=SEQ), batch_size=2)


def make_trainer(cfg: dict) -> L.Trainer:
    strategy = SlideDPStrategy(**cfg.get("strategy", {}), timeout=timedelta(seconds=cfg.get("pg_timeout", 60)))
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=cfg.get("devices", 2),
        max_steps=cfg.get("steps", 3),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=cfg["out"],
    )


def main(path: str) -> None:
    cfg = json.loads(Path(path).read_text())
    torch.set_num_threads(1)
    if cfg.get("keep_groups"):
        from slidedp_lightning import process_groups
        from slidedp_lightning.runtime.topology import Topology

        process_groups.destroy_default_group = lambda *args, **kwargs: False  # type: ignore[assignment]
        Topology.destroy_groups = Topology.released  # type: ignore[method-assign]
    threads = {"before": thread_names()}
    module = LM(cfg)
    trainer = make_trainer(cfg)
    trainer.fit(module, loader(cfg))
    threads["after_fit"] = thread_names()
    refit = cfg.get("refit")
    if refit == "validate":
        trainer.validate(module, loader(cfg), verbose=False)
        threads["after_refit"] = thread_names()
    elif refit == "fit":
        trainer = make_trainer(cfg)
        trainer.fit(module, loader(cfg))
        threads["after_refit"] = thread_names()
    rank = trainer.global_rank
    with open(os.path.join(cfg["out"], f"threads_rank{rank}.json"), "w") as f:
        json.dump(threads, f)
    with open(os.path.join(cfg["out"], f"done_rank{rank}"), "w") as f:  # the very last statement
        f.write("ok\n")


if __name__ == "__main__":
    main(sys.argv[1])
