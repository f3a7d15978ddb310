"""A small 2-rank SlideDP job for the reliability tests and the exit soak: ``python reliability_job.py CONFIG.json``.

CONFIG.json (every key optional): ``out`` (folder for the per-rank records), ``devices`` (2), ``steps`` (3),
``strategy`` (SlideDPStrategy keyword arguments), ``refit`` (after fit, ``"validate"`` or ``"fit"`` again in the same
processes), ``last_collective`` (an all-reduce and a barrier in ``on_train_end``, right before teardown),
``stop_rank``/``stop_at_step`` (that rank SIGSTOPs itself in that training step), ``signal_rank``/
``signal_at_step``/``signal`` (that rank sends itself the signal, e.g. ``"SIGTERM"``), ``pg_timeout`` (s),
``keep_groups`` (leave the process groups alive at teardown, as before the strategy destroyed them: the exit soak's
comparison, experiments/soak_exit.py), ``slurm_requeue`` (``SLURMEnvironment(auto_requeue=True)``: the ranks are
started by the caller with SLURM's variables, as srun would), ``constant_data`` (every sample the same: a resume
mid-epoch sees the same batches), ``save_every`` (a checkpoint ``ckpt/step-<n>`` every n steps), ``step_sleep`` (s,
in every training step: a wider window for a signal). The other rank starts with the script, before its imports, as
``slidedp-finetune``'s do (``slidedp_lightning.process.early_ranks``).

Per rank it writes ``threads_rank{r}.json`` (the native thread names before the first Trainer and after each
Trainer call), ``pid_rank{r}`` at the start of training, ``step_rank{r}`` (the step being trained), ``shm_rank{r}``
(bytes used on the ledger directory's filesystem at the start of training), ``losses_rank{r}.json`` (global step
and loss of each step) and ``final_state.pt`` (rank 0: the weights after fit), and ``done_rank{r}`` as its very last
statement.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

from slidedp_lightning_cli.task import early_ranks

# as slidedp-finetune does: the other rank starts now and imports while this one does
early_ranks.begin(json.loads(Path(sys.argv[1]).read_text()).get("devices", 2) if __name__ == "__main__" else 1)

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.fabric.plugins.environments import SLURMEnvironment  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

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
        self.losses: list[tuple[int, float]] = []

    def on_train_start(self) -> None:
        from slidedp_lightning.runtime.ledger.preflight import shm_dir

        st = os.statvfs(shm_dir())
        self._write(f"shm_rank{self.global_rank}", str((st.f_blocks - st.f_bfree) * st.f_frsize))
        self._write(f"pid_rank{self.global_rank}", str(os.getpid()))

    def _write(self, name: str, text: str) -> None:
        with open(os.path.join(self.cfg["out"], name), "w") as f:
            f.write(text)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        cfg = self.cfg
        self._write(f"step_rank{self.global_rank}", str(self.trainer.global_step))
        if cfg.get("step_sleep"):
            time.sleep(cfg["step_sleep"])
        if batch_idx == cfg.get("stop_at_step") and self.global_rank == cfg.get("stop_rank"):
            os.kill(os.getpid(), signal.SIGSTOP)
        if batch_idx == cfg.get("signal_at_step") and self.global_rank == cfg.get("signal_rank"):
            os.kill(os.getpid(), getattr(signal, cfg.get("signal", "SIGTERM")))
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, sync_dist=True)
        self.losses.append((self.trainer.global_step, loss.item()))
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        every = self.cfg.get("save_every")
        if every and self.trainer.global_step % every == 0:
            self.trainer.save_checkpoint(os.path.join(self.cfg["out"], "ckpt", f"step-{self.trainer.global_step}"))

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
    data = Tokens(n, seed=3, vocab=VOCAB, seq=SEQ)
    if cfg.get("constant_data"):
        data.data = data.data[:1].expand_as(data.data).clone()
    return DataLoader(data, batch_size=2)


def make_trainer(cfg: dict) -> L.Trainer:
    strategy = SlideDPStrategy(**cfg.get("strategy", {}), timeout=timedelta(seconds=cfg.get("pg_timeout", 60)))
    plugins = [SLURMEnvironment(auto_requeue=True)] if cfg.get("slurm_requeue") else None
    return L.Trainer(
        strategy=strategy,
        plugins=plugins,
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
        from slidedp_lightning.process import groups as process_groups
        from slidedp_lightning.runtime.topology import Topology

        process_groups.destroy_default_group = lambda *args, **kwargs: False  # type: ignore[assignment]
        Topology.destroy_groups = Topology.released  # type: ignore[method-assign]
    threads = {"before": thread_names()}
    module = LM(cfg)
    trainer = make_trainer(cfg)
    trainer.fit(module, loader(cfg))
    threads["after_fit"] = thread_names()
    rank = trainer.global_rank
    module._write(f"losses_rank{rank}.json", json.dumps(module.losses))
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, Path(cfg["out"]) / "final_state.pt")
    refit = cfg.get("refit")
    if refit == "validate":
        trainer.validate(module, loader(cfg), verbose=False)
        threads["after_refit"] = thread_names()
    elif refit == "fit":
        trainer = make_trainer(cfg)
        trainer.fit(module, loader(cfg))
        threads["after_refit"] = thread_names()
    with open(os.path.join(cfg["out"], f"threads_rank{rank}.json"), "w") as f:
        json.dump(threads, f)
    with open(os.path.join(cfg["out"], f"done_rank{rank}"), "w") as f:  # the very last statement
        f.write("ok\n")


if __name__ == "__main__":
    early_ranks.wait_for_launch()
    main(sys.argv[1])
    gc.freeze()  # exit without collecting the heap again (see slidedp_lightning_cli.finetune.cli)
