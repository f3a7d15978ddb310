"""Fine-tuning on the user's own JSONL data (``slidedp-finetune --model DIR --data train.jsonl``).

:class:`DataFinetuneModule` is :class:`~slidedp_lightning.recipes.module.FinetuneModule` with its data from
:mod:`slidedp_lightning.recipes.data` and exact validation metrics (summed over every loss token of the set, across
ranks, each example counted once).  :class:`TokenThroughput` logs training tokens/s; :func:`export` writes the
trained model and the tokenizer as a ``save_pretrained`` directory.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from slidedp_lightning.recipes.data import EvalShard, JsonlDataset
from slidedp_lightning.recipes.module import FinetuneModule
from slidedp_lightning.recipes.packing import PackedDataset
from slidedp_lightning.recipes.settings import pack_problem
from slidedp_lightning.recipes.synthetic import IGNORE_INDEX

log = logging.getLogger(__name__)


def load_tokenizer(model_dir: str) -> Any:
    """The tokenizer (and chat template) saved in ``model_dir``; local files only."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def sum_metrics(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[loss_sum, correct, tokens, exact_rows, rows]`` (float64) over the loss tokens of a batch."""
    target = labels[:, 1:]
    logits = logits[:, :-1].float()
    loss_sum = F.cross_entropy(logits.transpose(1, 2), target, ignore_index=IGNORE_INDEX, reduction="sum")
    mask = target != IGNORE_INDEX
    hit = (logits.argmax(dim=-1) == target) & mask
    has = mask.any(dim=1)
    exact = ((hit | ~mask).all(dim=1) & has).sum()
    values = [loss_sum.detach(), hit.sum(), mask.sum(), exact, has.sum()]
    return torch.stack([v.to(torch.float64) for v in values])


def metrics_from_sums(sums: torch.Tensor) -> dict[str, float]:
    """``val_loss`` (mean per loss token), ``val_acc`` (token accuracy), ``val_exact`` (rows all right)."""
    loss_sum, correct, tokens, exact, rows = (float(v) for v in sums)
    tokens = max(tokens, 1.0)
    return {"val_loss": loss_sum / tokens, "val_acc": correct / tokens, "val_exact": exact / max(rows, 1.0)}


class DataFinetuneModule(FinetuneModule):
    """Causal-LM fine-tuning on JSONL files tokenized with the checkpoint's own tokenizer."""

    def __init__(
        self,
        model_dir: str,
        data: str,
        val_data: str | None = None,
        val_split: float | None = None,
        seq_len: int = 256,
        batch_size: int = 8,
        eval_batch_size: int = 32,
        lr: float = 1e-4,
        weight_decay: float = 0.01,
        warmup_steps: int | None = None,
        seed: int = 1234,
        lr_schedule: str = "cosine",
        chunked_loss: int = 0,
        lora: dict[str, Any] | None = None,
        pack: bool = False,
        truncate: bool = False,
    ) -> None:
        super().__init__(
            model_dir=model_dir,
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            lr=lr,
            weight_decay=weight_decay,
            warmup_steps=warmup_steps,
            seed=seed,
            lr_schedule=lr_schedule,
            chunked_loss=chunked_loss,
            lora=lora,
        )
        self.save_hyperparameters()
        self.tokenizer = load_tokenizer(model_dir)
        # read and checked now, in every process, before any Trainer work: bad data fails fast with file:line
        examples = JsonlDataset(data, self.tokenizer, seq_len, truncate=truncate)
        self.val_data = JsonlDataset(val_data, self.tokenizer, seq_len, truncate=truncate) if val_data else examples
        if val_split:  # held out of --data, the same on every rank (seeded)
            examples, self.val_data = examples.split(val_split, seed)
        self.train_examples = examples
        # validation keeps one example a row: its metrics (exact rows included) are per example
        self.train_data: JsonlDataset | PackedDataset = PackedDataset(examples) if pack else examples

    def _unpacked_fill(self) -> float:
        mask = self.train_examples.attention_mask
        return float(mask.sum()) / max(1, mask.numel())

    def packing_facts(self) -> dict[str, float]:
        """``pack_factor``: examples (so tokens) per row packed over one a row; ``row_fill``: non-padding share
        of the training rows (1.0 / the unpacked fill when not packed)."""
        if not isinstance(self.train_data, PackedDataset):
            return {"pack_factor": 1.0, "row_fill": self._unpacked_fill()}
        return {"pack_factor": self.train_data.examples / len(self.train_data), "row_fill": self.train_data.fill}

    def check_model(self, model: Any) -> None:
        problem = pack_problem(getattr(model.config, "model_type", None)) if self.hp.pack else None
        if problem is not None:
            raise ValueError(f"{self.hp.model_dir}: {problem}")
        vocab = model.get_input_embeddings().num_embeddings
        if len(self.tokenizer) > vocab:
            raise ValueError(
                f"{self.hp.model_dir}: the tokenizer has {len(self.tokenizer)} tokens but the model's "
                f"embedding only {vocab}"
            )

    def epoch_data(self) -> tuple[Any, bool]:
        return self.train_data, True

    def train_dataloader(self) -> DataLoader:
        _, world = self._rank_world()
        if len(self.train_data) < self.hp.batch_size * world:
            raise ValueError(
                f"{self.hp.data}: {len(self.train_data)} {'packed rows' if self.hp.pack else 'examples'}, fewer than "
                "one global batch "
                f"({self.hp.batch_size} x {world} ranks)"
            )
        return super().train_dataloader()

    def val_dataloader(self) -> DataLoader:
        rank, world = self._rank_world()
        return DataLoader(EvalShard(self.val_data, rank, world), batch_size=self.hp.eval_batch_size)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        out = self(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        self._add_sums(sum_metrics(out.logits, batch["labels"]))

    def on_validation_epoch_end(self) -> None:
        self.val_metrics = metrics_from_sums(self._reduced_sums())
        for name, value in self.val_metrics.items():
            self.log(name, value, prog_bar=name == "val_acc", sync_dist=True)  # equal on all ranks: mean is exact


class TokenThroughput(L.Callback):
    """Log ``train_tokens_per_s`` (non-padding tokens of all ranks per second of the batch, rank 0's clock) and
    ``step_s`` (seconds of the last optimizer step, accumulation included); both show in the step bar."""

    def __init__(self) -> None:
        self._t: float | None = None
        self._step_t: float | None = None
        self.rates: list[float] = []  # tokens/s of every batch but the first (it includes the warm-up)
        self.steps: list[float] = []  # seconds of every optimizer step but the first

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._t is None:
            self._t = self._step_t = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._t is not None:
            mask = batch.get("attention_mask")
            real = mask.sum() if mask is not None else batch["num_tokens"].sum()  # packed rows: no mask
            tokens = float(real) * trainer.world_size
            rate = tokens / max(now - self._t, 1e-9)
            pl_module.log("train_tokens_per_s", rate, on_step=True, on_epoch=False, prog_bar=True)
            self.rates.append(rate)
        if self._step_t is not None and (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            pl_module.log("step_s", now - self._step_t, on_step=True, on_epoch=False, prog_bar=True)
            self.steps.append(now - self._step_t)
            self._step_t = now
        self._t = now


def export(
    trainer: L.Trainer, module: DataFinetuneModule, out: str, dtype: torch.dtype, adapter_only: bool = False
) -> None:
    """Write the model (non-SlideDP strategies: the module's model, a LoRA model merged unless ``adapter_only``;
    SlideDP exports through its :class:`~slidedp_lightning.SaveHuggingFace` callback) and the tokenizer to ``out``
    (rank 0 writes)."""
    from slidedp_lightning.hf.export import export_directory
    from slidedp_lightning.strategy import SlideDPStrategy

    if trainer.is_global_zero:
        if not isinstance(trainer.strategy, SlideDPStrategy):
            assert module.model is not None
            model: Any = copy.deepcopy(module.model).to(dtype)
            if hasattr(model, "peft_config") and not adapter_only:
                model = model.merge_and_unload()  # what SlideDP's export writes for a LoRA model
            model.config.use_cache = True
            with export_directory(out) as tmp:  # written aside and swapped in, as SlideDP's export
                model.save_pretrained(tmp)
                module.tokenizer.save_pretrained(tmp)
        else:
            module.tokenizer.save_pretrained(out)
        log.info("exported %s model and tokenizer to %s", dtype, os.path.abspath(out))
    trainer.strategy.barrier("export")
