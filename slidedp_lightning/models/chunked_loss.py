"""The causal-LM loss in sequence chunks: the head never holds the full ``[batch, seq, vocab]`` logits.

:func:`use_chunked_loss` (alias :func:`install`) replaces a transformers ``*ForCausalLM`` instance's forward: with ``labels`` it runs the
base model, then calls ``lm_head(hidden, labels=...)`` (a module call, so SlideDP's hooks make the head
resident), whose forward is :class:`ChunkedLinearCrossEntropy`: ``chunk`` tokens at a time, logits in the
compute dtype upcast to FP32 and summed cross-entropy, as transformers' ``ForCausalLMLoss`` computes it.
Only the hidden states are kept for backward; each chunk's logits are recomputed there and differentiated
by autograd (the same operations as the plain loss). MoE models keep their router auxiliary loss.
Without labels the model behaves as before (logits returned).
"""

from __future__ import annotations

import sys
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -100


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``sum_t CE(hidden[t] @ weight.T, target[t]) / denom`` computed ``chunk`` rows at a time."""

    @staticmethod
    def forward(
        ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, denom: torch.Tensor
    ) -> torch.Tensor:
        device = hidden.device.type
        ctx.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device), device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            logits = F.linear(hidden[s : s + chunk], weight).float()
            total = total + F.cross_entropy(logits, targets[s : s + chunk], ignore_index=IGNORE, reduction="sum")
        ctx.save_for_backward(hidden, weight, targets, denom)
        ctx.chunk = chunk
        return total / denom

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight, targets, denom = ctx.saved_tensors
        enabled, dtype, device = ctx.autocast
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight)
        w = weight.detach().requires_grad_()
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            for s in range(0, hidden.shape[0], ctx.chunk):
                h = hidden[s : s + ctx.chunk].detach().requires_grad_()
                logits = F.linear(h, w).float()
                part = F.cross_entropy(logits, targets[s : s + ctx.chunk], ignore_index=IGNORE, reduction="sum")
                gh, gw = torch.autograd.grad(part / denom, (h, w), grad)
                grad_hidden[s : s + ctx.chunk] = gh
                grad_weight += gw
        return grad_hidden, grad_weight, None, None, None


def _head_forward(
    head: nn.Linear,
    hidden: torch.Tensor,
    labels: torch.Tensor | None = None,
    chunk: int = 1024,
    num_items_in_batch: torch.Tensor | None = None,
) -> torch.Tensor:
    if labels is None:
        return F.linear(hidden, head.weight, head.bias)
    if head.bias is not None:
        raise ValueError("the chunked loss supports an lm_head without bias only.")
    targets = F.pad(labels, (0, 1), value=IGNORE)[..., 1:].reshape(-1).to(hidden.device)
    denom = num_items_in_batch if num_items_in_batch is not None else (targets != IGNORE).sum()
    denom = torch.as_tensor(denom, device=hidden.device).float()
    return ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), head.weight, targets, chunk, denom)


def install(model: nn.Module, chunk: int) -> None:
    """Compute ``model``'s training loss ``chunk`` tokens at a time (see the module docstring)."""
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"loss chunk must be a positive number of tokens, got {chunk!r}.")
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or not hasattr(model, "model"):
        raise ValueError(
            f"{type(model).__name__} is not a transformers causal LM with an lm_head: the chunked loss "
            "does not apply; do not call use_chunked_loss on it."
        )
    original = type(model).forward
    # a per-instance forward on purpose (uninstall() pops it); nn.Linear declares forward as a method
    head.forward = MethodType(  # type: ignore[method-assign]
        lambda self, hidden, **kw: _head_forward(self, hidden, chunk=chunk, **kw), head
    )
    module = sys.modules[type(model).__module__]

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        logits_to_keep=0,
        **kwargs,
    ):
        if labels is None or logits_to_keep:
            return original(
                self,
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                inputs_embeds=inputs_embeds,
                labels=labels,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        router = kwargs.pop("output_router_logits", getattr(self.config, "output_router_logits", False))
        extra = {"output_router_logits": router} if hasattr(self.config, "output_router_logits") else {}
        kwargs["use_cache"] = False
        items = kwargs.get("num_items_in_batch")
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            **extra,
            **kwargs,
        )
        loss = self.lm_head(outputs.last_hidden_state, labels=labels, num_items_in_batch=items)
        aux = None
        if router:  # the MoE router's load-balancing loss, as the model's own forward adds it
            aux = module.load_balancing_loss_func(
                outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask
            )
            loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
        out = {"loss": loss, "logits": None}
        if aux is not None:
            out["aux_loss"] = aux
        kind = "MoeCausalLMOutputWithPast" if aux is not None else "CausalLMOutputWithPast"
        return getattr(module, kind)(**out)

    model.forward = MethodType(forward, model)
    # torch types Module.__setattr__'s value as Tensor | Module; a plain attribute is accepted at runtime
    model._slidedp_chunked_loss = chunk  # type: ignore[assignment]


def uninstall(model: nn.Module) -> None:
    """Restore the class forwards of ``model`` and its head."""
    if getattr(model, "_slidedp_chunked_loss", None) is None:
        return
    for m in (model, model.lm_head):
        m.__dict__.pop("forward", None)
    del model._slidedp_chunked_loss


def use_chunked_loss(model: nn.Module, tokens: int) -> nn.Module:
    """Compute a transformers causal LM's training loss (``model(..., labels=...)``) ``tokens`` tokens at a time,
    so the head never holds the full ``[batch, seq, vocab]`` logits; returns ``model``.

    Call it in ``LightningModule.configure_model`` on the ``*ForCausalLM`` instance. It works under any strategy
    (the same module runs under ``"ddp"`` for comparison) and with SlideDP's streamed head.
    """
    install(model, tokens)
    return model
