"""Lightning callbacks for SlideDP runs. They recognise the strategy by its ``strategy_name``: the strategy reads
:class:`LaneTrace`, and this module does not import the strategy back."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch

from slidedp_lightning.constants import STRATEGY_NAME


def _is_slidedp(trainer: pl.Trainer) -> bool:
    return getattr(trainer.strategy, "strategy_name", None) == STRATEGY_NAME


class SaveHuggingFace(pl.Callback):
    """At the end of training (and every ``every_n_train_steps`` if given), export the model from the host ledger
    as a Hugging Face ``save_pretrained`` directory (``dirpath``, or ``dirpath/step=<n>`` for periodic exports),
    written aside and swapped into place. A peft (LoRA) model exports merged (transformers loads it without peft);
    ``adapter_only=True`` writes its adapters alone in peft's format (``PeftModel.from_pretrained``)."""

    def __init__(
        self,
        dirpath: str | os.PathLike,
        dtype: str | torch.dtype = torch.bfloat16,
        every_n_train_steps: int | None = None,
        adapter_only: bool = False,
    ) -> None:
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be >= 1 or None, got {every_n_train_steps}.")
        from slidedp_lightning.hf.export import check_export_target

        check_export_target(dirpath)  # a path that cannot take an export fails now, not after training
        self.dirpath, self.dtype, self.every, self.adapter_only = dirpath, dtype, every_n_train_steps, adapter_only
        self._last = -1

    def _strategy(self, trainer: pl.Trainer) -> Any:
        if not _is_slidedp(trainer):
            raise TypeError(
                f"SaveHuggingFace exports from SlideDP's ledger; the Trainer runs "
                f"{type(trainer.strategy).__name__}. Use save_pretrained on the model instead."
            )
        return trainer.strategy

    def _save(self, trainer: pl.Trainer, directory: str | os.PathLike) -> None:
        strategy = self._strategy(trainer)
        if not self.adapter_only:
            strategy.save_hf(directory, self.dtype)
            return
        from slidedp_lightning.hf import export

        if strategy.engine is None:
            raise RuntimeError(
                "SaveHuggingFace exports from the host ledger, which exists only while the Trainer runs."
            )
        export.save_hf(strategy.engine, directory, self.dtype, adapter_only=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.every and step and step % self.every == 0 and step != self._last:  # once per optimizer step
            self._last = step
            self._save(trainer, os.path.join(self.dirpath, f"step={trainer.global_step}"))

    def on_train_end(self, trainer, pl_module) -> None:
        self._save(trainer, self.dirpath)


class LaneTrace(pl.Callback):
    """Record every lane operation of a SlideDP run (``docs/step.md``, "Lane traces").

    Each rank writes TensorBoard scalars (busy time per lane, exposed host time, overlap fraction, the share of
    the compute thread's time its spans cover), a Gantt figure of step 2 (in TensorBoard and as
    ``gantt_rank{r}.png``) and ``trace_rank{r}.json`` (open it in Perfetto or ``chrome://tracing``) under
    ``dirpath``. Read by the strategy when it builds its engine; without this callback tracing costs nothing.
    """

    def __init__(self, dirpath: str | os.PathLike) -> None:
        self.dirpath = os.fspath(dirpath)

    @staticmethod
    def dir_for(trainer: pl.Trainer) -> str | None:
        """The trace directory of the Trainer's LaneTrace callback, or None without one."""
        # Trainer.callbacks is assigned by Lightning's callback connector, never declared on the class
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        found = [cb for cb in callbacks if isinstance(cb, LaneTrace)]
        if len(found) > 1:
            raise ValueError(f"one LaneTrace callback per Trainer, got {len(found)}.")
        return found[0].dirpath if found else None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not _is_slidedp(trainer):
            raise TypeError(f"LaneTrace records SlideDP's lanes; the Trainer runs {type(trainer.strategy).__name__}.")
