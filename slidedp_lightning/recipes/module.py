"""The fine-tuning job's LightningModule: a causal LM trained on the synthetic task of
:mod:`slidedp_lightning.recipes.synthetic` (``slidedp-finetune``; the CLI is :mod:`slidedp_lightning.recipes.finetune`).

:class:`FinetuneModule` builds its model in ``configure_model``, logs ``train_loss`` and ``val_loss`` /
``val_acc`` / ``val_exact``, and keeps the metrics of its last validation pass, reduced over the ranks, in
:attr:`FinetuneModule.val_metrics` (a pass inside ``fit`` included, e.g. Lightning's sanity check, whose logged
values Lightning drops).
"""

from __future__ import annotations

import json
import math
import os
from importlib import resources
from typing import Any

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

import slidedp_lightning
from slidedp_lightning.recipes.order import POSITION, ResumingSampler
from slidedp_lightning.recipes.settings import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_CONFIG,
    DEFAULT_LR,
    DEFAULT_LR_SCHEDULE,
    DEFAULT_SEED,
    DEFAULT_WEIGHT_DECAY,
    EVAL_BATCH_SIZE,
    EVAL_SEED_OFFSET,
    EVAL_SIZE,
    LR_SCHEDULES,
    TASK,
    TRAIN_SIZE,
    check_vocab,
)
from slidedp_lightning.recipes.synthetic import SyntheticTaskDataset, TaskSpec, answer_accuracy_counts

__all__ = ["FinetuneModule", "checkpoint_vocab_size", "load_tiny_config", "metrics_of_sums"]


def metrics_of_sums(sums: torch.Tensor) -> dict[str, float]:
    """``[loss x rows, correct, answer tokens, exact rows, rows]`` summed over a set -> ``val_loss`` (mean over
    examples; every example has as many answer tokens), ``val_acc``, ``val_exact``."""
    loss_rows, correct, tokens, exact, rows = (float(v) for v in sums)
    return {
        "val_loss": loss_rows / max(rows, 1.0) if rows else float("nan"),
        "val_acc": correct / max(tokens, 1.0),
        "val_exact": exact / max(rows, 1.0),
    }


def load_tiny_config(name: str = DEFAULT_CONFIG) -> tuple[Any, str]:
    """Return ``(Qwen3Config, attn_implementation)`` for a config shipped in ``configs/``."""
    from transformers import Qwen3Config

    text = resources.files("slidedp_lightning.recipes").joinpath("configs", name).read_text()
    data = json.loads(text)
    attn = data.pop("attn_implementation", "sdpa")
    return Qwen3Config.from_dict(data), attn


def checkpoint_vocab_size(model_dir: str) -> int:
    """Vocabulary size of a local Hugging Face checkpoint directory (reads only its config)."""
    from transformers import AutoConfig

    if not os.path.isdir(model_dir):
        raise ValueError(f"{model_dir!r} is not a directory (expected a local Hugging Face checkpoint)")
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text_config.vocab_size)


def _with_lora(model: Any, lora: dict[str, Any]) -> Any:
    """``model`` with peft's LoRA adapters (``lora``: :func:`~slidedp_lightning.recipes.settings.lora_settings`)."""
    import peft

    config = peft.LoraConfig(
        r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], target_modules=lora["targets"]
    )
    try:
        return peft.get_peft_model(model, config)
    except ValueError as err:  # peft: no module of the model matches the targets
        raise ValueError(f"--lora-targets {lora['targets']}: {' '.join(str(err).split())}") from None


class FinetuneModule(L.LightningModule):
    """Causal-LM fine-tuning on :class:`~slidedp_lightning.recipes.synthetic.SyntheticTaskDataset`.

    The model is built in :meth:`configure_model` (idempotent), not in
    ``__init__``, so strategies can control where and how it is created.
    """

    def __init__(
        self,
        model_dir: str | None = None,
        config_name: str = DEFAULT_CONFIG,
        task: str = TASK.task,
        num_symbols: int = TASK.num_symbols,
        length: int = TASK.length,
        train_size: int = TRAIN_SIZE,
        eval_size: int = EVAL_SIZE,
        batch_size: int = DEFAULT_BATCH_SIZE,
        eval_batch_size: int = EVAL_BATCH_SIZE,
        lr: float = DEFAULT_LR,
        weight_decay: float = DEFAULT_WEIGHT_DECAY,
        warmup_steps: int | None = None,
        seed: int = DEFAULT_SEED,
        lr_schedule: str = DEFAULT_LR_SCHEDULE,
        chunked_loss: int = 0,
        lora: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {lr_schedule!r}")
        self.save_hyperparameters()
        self.spec = TaskSpec(task=task, num_symbols=num_symbols, length=length)
        self.model: torch.nn.Module | None = None
        self._nonfinite_steps: torch.Tensor | None = None  # count, kept on the loss's device (no per-step sync)
        self._train_set: SyntheticTaskDataset | None = None
        self._eval_set: SyntheticTaskDataset | None = None
        self._sums: torch.Tensor | None = None  # this rank's metric sums over the current validation pass
        # the last validation pass's metrics, reduced over the ranks (set on every rank)
        self.val_metrics: dict[str, float] | None = None
        self._position: dict[str, int] | None = None  # the data position a checkpoint taken now records
        self._resume_position: dict[str, int] | None = None  # the one the run resumed from

    @property
    def hp(self) -> Any:
        """The saved hyperparameters (attribute access)."""
        return self.hparams

    # ----------------------------------------------------------------- model
    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        hp = self.hp
        # Same weights on every rank, whatever RNG state the caller left.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(hp.seed)
            if hp.model_dir is not None:  # under SlideDP: a meta skeleton, the checkpoint read into the ledger
                model: Any = slidedp_lightning.from_pretrained(hp.model_dir, attn_implementation="sdpa")
            else:
                config, attn = load_tiny_config(hp.config_name)
                model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
        self.check_model(model)
        if hp.chunked_loss:  # the head never holds the whole [batch, seq, vocab] logits
            slidedp_lightning.use_chunked_loss(model, hp.chunked_loss)
        if hp.lora:  # adapters on the checkpoint's weights, which stay frozen
            model = _with_lora(model, hp.lora)
        model.train()  # from_pretrained returns the model in eval mode
        if getattr(model.config, "use_cache", False):
            model.config.use_cache = False
        self.model = model

    def check_model(self, model: Any) -> None:
        """Refuse a model whose vocabulary the data cannot use."""
        vocab = model.get_input_embeddings().num_embeddings
        check_vocab(vocab, self.spec, self.hp.model_dir or self.hp.config_name)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ):
        """The model's forward without a KV cache (packed rows, ``position_ids`` without a mask, need none: see
        :mod:`~slidedp_lightning.recipes.packing`)."""
        assert self.model is not None, "configure_model() has not run"
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            labels=labels,
            use_cache=False,
        )

    # ------------------------------------------------------------------ data
    def train_set(self) -> SyntheticTaskDataset:
        if self._train_set is None:
            self._train_set = SyntheticTaskDataset(self.spec, self.hp.train_size, seed=self.hp.seed)
        return self._train_set

    def eval_set(self) -> SyntheticTaskDataset:
        if self._eval_set is None:
            seed = self.hp.seed + EVAL_SEED_OFFSET
            self._eval_set = SyntheticTaskDataset(self.spec, self.hp.eval_size, seed=seed)
        return self._eval_set

    def _rank_world(self) -> tuple[int, int]:
        trainer = self._trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def train_sampler(self, dataset: Any, drop_last: bool) -> ResumingSampler:
        """This rank's share of ``dataset`` in a seeded order that a resumed run continues (see
        :mod:`~slidedp_lightning.recipes.order`)."""
        rank, world = self._rank_world()
        sampler = ResumingSampler(
            dataset, num_replicas=world, rank=rank, shuffle=True, seed=self.hp.seed, drop_last=drop_last,
            batch_size=self.hp.batch_size,
        )  # fmt: skip
        if self._resume_position is not None:
            sampler.resume_at(self._resume_position["epoch"], self._resume_position["batches"])
        return sampler

    def epoch_data(self) -> tuple[Any, bool]:
        """The training examples and whether a rank's share drops the remainder instead of padding to equal
        shares (here: padded, as Lightning's own DistributedSampler did for this task)."""
        return self.train_set(), False

    def batches_per_epoch(self, world: int) -> int:
        """Training batches a rank runs in one pass over the data with ``world`` ranks."""
        data, drop_last = self.epoch_data()
        return len(DistributedSampler(data, num_replicas=world, rank=0, drop_last=drop_last)) // self.hp.batch_size

    def train_dataloader(self) -> DataLoader:
        data, drop_last = self.epoch_data()
        sampler = self.train_sampler(data, drop_last=drop_last)
        return DataLoader(data, batch_size=self.hp.batch_size, sampler=sampler, drop_last=True)

    # ----------------------------------------------------------- resumption
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._position = {"epoch": self.trainer.current_epoch, "batches": batch_idx + 1}  # once this batch is done

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self._position is not None:
            checkpoint[POSITION] = dict(self._position)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._resume_position = checkpoint.get(POSITION)

    def val_dataloader(self) -> DataLoader:
        rank, world = self._rank_world()  # the sampler Lightning's own would be: in order, padded to equal shares
        sampler: DistributedSampler = DistributedSampler(self.eval_set(), num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(self.eval_set(), batch_size=self.hp.eval_batch_size, sampler=sampler)

    @property
    def nonfinite_loss_steps(self) -> int:
        """Training steps on this rank whose loss was NaN or inf."""
        return 0 if self._nonfinite_steps is None else int(self._nonfinite_steps.item())

    # -------------------------------------------------------------- training
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(
            batch["input_ids"], batch.get("attention_mask"), batch["labels"], position_ids=batch.get("position_ids")
        ).loss
        bad = (~torch.isfinite(loss.detach())).long()
        self._nonfinite_steps = bad if self._nonfinite_steps is None else self._nonfinite_steps + bad
        self.log("train_loss", loss, prog_bar=True, sync_dist=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        # the accuracy needs the logits, which a chunked loss never forms: the forward without labels, then the
        # model's own loss function on them (what its forward computes with labels)
        model: Any = self.model  # a transformers causal LM
        logits = self(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
        loss = model.loss_function(logits=logits, labels=batch["labels"], vocab_size=model.config.vocab_size)
        correct, total, exact = answer_accuracy_counts(logits, batch["labels"])
        n = batch["input_ids"].shape[0]
        # Every example has the same number of answer tokens, so batch-size
        # weighted means of these per-batch values are exact over the set.
        self.log("val_loss", loss, sync_dist=True, batch_size=n)
        self.log("val_acc", correct.float() / total.clamp_min(1), prog_bar=True, sync_dist=True, batch_size=n)
        self.log("val_exact", exact.float() / n, sync_dist=True, batch_size=n)
        values = [loss.detach() * n, correct, total, exact, torch.tensor(n, device=loss.device)]
        self._add_sums(torch.stack([v.to(torch.float64) for v in values]))

    def on_validation_epoch_start(self) -> None:
        self._sums = None

    def on_validation_epoch_end(self) -> None:
        self.val_metrics = metrics_of_sums(self._reduced_sums())

    def _add_sums(self, sums: torch.Tensor) -> None:
        self._sums = sums if self._sums is None else self._sums + sums

    def _reduced_sums(self) -> torch.Tensor:
        """This pass's sums over every rank (a collective: called on every rank)."""
        sums = self._sums if self._sums is not None else torch.zeros(5, dtype=torch.float64, device=self.device)
        return self.trainer.strategy.reduce(sums, reduce_op="sum")

    def configure_optimizers(self):
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            is_norm_or_bias = p.ndim < 2 or "norm" in name.lower() or name.endswith(".bias")
            (no_decay if is_norm_or_bias else decay).append(p)
        groups = [
            {"params": decay, "weight_decay": self.hp.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.hp.lr, betas=(0.9, 0.95))

        total = self.trainer.max_steps
        if total is None or total < 0:
            total = int(self.trainer.estimated_stepping_batches)
        total = max(1, int(total))
        warmup = self.hp.warmup_steps
        if warmup is None:
            warmup = max(1, total // 10)
        warmup = max(0, min(int(warmup), total))

        schedule = self.hp.lr_schedule

        def lr_lambda(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            if schedule == "constant":
                return 1.0
            if schedule == "linear":
                return 1.0 - progress
            return 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}
