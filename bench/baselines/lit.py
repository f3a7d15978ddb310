"""The LightningModule and Trainer run shared by the Lightning systems (SlideDP, its replicated mode, DDP)."""

from __future__ import annotations

import os
import time
from dataclasses import asdict

import lightning as L
import torch

from bench.baselines.record import Recorder
from bench.baselines.workload import JobSpec, adamw_groups, build_model, rank_loader


class BenchLM(L.LightningModule):
    """Causal-LM loss on the workload's tokens; records step starts and per-step loss.

    ``loss_chunk``: compute the loss ``loss_chunk`` tokens at a time (:func:`slidedp_lightning.use_chunked_loss`).
    """

    def __init__(
        self, spec: JobSpec, rec: Recorder, hf_checkpointing: bool, fused_adamw: bool, loss_chunk: int | None = None
    ) -> None:
        super().__init__()
        self.spec, self.rec = spec, rec
        self.hf_checkpointing, self.fused_adamw, self.loss_chunk = hf_checkpointing, fused_adamw, loss_chunk
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            self._t_load = time.perf_counter()
            if self.spec.checkpoint_dir and self.spec.system in ("slidedp", "replicated"):
                import slidedp_lightning

                self.model = slidedp_lightning.from_pretrained(self.spec.checkpoint_dir)
            else:
                self.model = build_model(self.spec)
            self.model.config.use_cache = False
            if self.hf_checkpointing:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if self.loss_chunk:
                from slidedp_lightning import use_chunked_loss

                use_chunked_loss(self.model, self.loss_chunk)

    def on_train_start(self) -> None:
        # configure_model to here: the model built and its weights loaded (SlideDP: read into the ledger)
        self.rec.extra["load_s"] = time.perf_counter() - self._t_load

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        self.rec.step_start()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.rec.batch(batch)
        loss = self.model(input_ids=batch, labels=batch).loss
        self.rec.loss(loss.item())
        return loss

    def configure_optimizers(self):
        h = self.spec.hyper
        kw = {"fused": True} if self.fused_adamw else {}
        return torch.optim.AdamW(adamw_groups(self, h), lr=h["lr"], betas=tuple(h["betas"]), eps=h["eps"], **kw)

    def train_dataloader(self):
        return rank_loader(self.spec, self.global_rank)

    def on_train_end(self) -> None:
        # the steps end here, before the strategy's teardown (where SlideDP gives the module FP32 copies of the
        # master weights while the ledger is still mapped): the plain systems also stop the window at their loop
        self.rec.steps_done()
        strategy = self.trainer.strategy
        engine = getattr(strategy, "engine", None)
        if engine is not None:
            self.rec.extra["device_memory"] = engine.device_memory()
            # the ledger's size and the pages it holds after the steps; "counted" on one rank per ledger file
            # (the rank that writes it), so a host's ledger memory is the sum over the counted ranks
            self.rec.extra["ledger"] = {**asdict(engine.ledger_stats()), "counted": strategy.topology.writes_ledger}
        if self.spec.save:
            t0 = time.perf_counter()
            self.trainer.save_checkpoint(os.path.join(self.trainer.default_root_dir, "checkpoint"))
            self.rec.extra["save_s"] = time.perf_counter() - t0
        if self.spec.export and engine is not None:
            t0 = time.perf_counter()
            strategy.save_hf(os.path.join(self.trainer.default_root_dir, "export"))
            self.rec.extra["export_s"] = time.perf_counter() - t0


def fit(
    spec: JobSpec,
    strategy,
    out: str,
    hf_checkpointing: bool,
    fused_adamw: bool,
    loss_chunk: int | None = None,
    callbacks: list | None = None,
) -> tuple[L.Trainer, BenchLM]:
    """One Lightning fit of ``spec``; the data split is the workload's own (``rank_loader``), as in every system."""
    rec = Recorder(out, rank=0)
    module = BenchLM(spec, rec, hf_checkpointing, fused_adamw, loss_chunk)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=spec.accelerator,
        devices=spec.ranks,
        precision=spec.precision,
        max_steps=spec.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=out,
        use_distributed_sampler=False,
        callbacks=callbacks or [],
    )
    rec.rank = trainer.global_rank
    trainer.fit(module)
    return trainer, module
