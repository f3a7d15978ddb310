"""What a SlideDP run refuses of the LightningModule and the Trainer before any ledger exists, because it
would silently do nothing under SlideDP."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.utilities.model_helpers import is_overridden

if TYPE_CHECKING:
    import lightning.pytorch as pl

# hooks that run after backward, where SlideDP's parameters hold no gradient (it went to host memory)
_GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step")


def refuse_what_cannot_see_gradients(trainer: pl.Trainer) -> None:
    """Before any ledger exists: refuse what would silently do nothing because SlideDP moves every gradient to host
    memory as it is produced (parameters never hold a ``.grad`` after backward) and runs the optimizer step itself:
    manual optimization, and hooks that run after backward (gradient-norm logging, checks, custom clipping)."""
    module = trainer.lightning_module
    if not module.automatic_optimization:
        raise ValueError(
            f"{type(module).__name__} sets automatic_optimization = False. SlideDP runs the optimizer step itself: "
            "each gradient leaves the device for host memory as it is produced and the CPU updates each unit as soon "
            "as its gradient is reduced, so under manual optimization it could not follow manual_backward, "
            "optimizer.step(), zero_grad(), self.clip_gradients() or skipped steps as you call them. Use automatic "
            "optimization (return the loss from training_step) with Trainer(accumulate_grad_batches=N) for "
            "accumulation and Trainer(gradient_clip_val=..., gradient_clip_algorithm='norm' or 'value') for "
            "clipping; with deferred updates (update='deferred', or clipping) a step with a non-finite gradient is "
            "skipped on every rank and trainer.strategy.last_grad_norm holds each step's global gradient norm."
        )
    hooks = (*_GRADIENT_HOOKS, "configure_gradient_clipping")
    found = [f"{type(module).__name__}.{h}" for h in hooks if is_overridden(h, module)]
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
    found += [f"{type(cb).__name__}.{h}" for cb in callbacks for h in _GRADIENT_HOOKS if is_overridden(h, cb)]
    if found:
        raise ValueError(
            f"{', '.join(found)} {'is' if len(found) == 1 else 'are'} overridden, but under SlideDP every "
            "parameter's .grad is None in on_after_backward and on_before_optimizer_step (each gradient goes to host "
            "memory as soon as it is produced, and the engine clips and applies it), so gradient-norm logging "
            "(lightning.pytorch.utilities.grad_norm), gradient checks or custom clipping there would silently do "
            "nothing. Clip with Trainer(gradient_clip_val=..., gradient_clip_algorithm='norm' or 'value'); read the "
            "global gradient norm of the last step from trainer.strategy.last_grad_norm (deferred updates: "
            "update='deferred', or clipping), e.g. in on_train_batch_end; move work that needs no gradient to "
            "another hook (on_train_batch_start, on_train_batch_end)."
        )
