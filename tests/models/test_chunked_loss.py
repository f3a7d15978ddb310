"""models.chunked_loss: the loss in sequence chunks equals transformers' loss and gradients, for dense and MoE
models, and never creates a full [batch, seq, vocab] tensor."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

from slidedp_lightning.models import chunked_loss
from tests.helpers import tiny_model, tiny_moe_config

VOCAB, SEQ, BATCH, HIDDEN = 96, 24, 2, 64


def dense(tied: bool = True) -> Qwen3ForCausalLM:
    return tiny_model(tied, vocab=VOCAB, max_positions=SEQ)


def moe() -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(tiny_moe_config(vocab=VOCAB, max_positions=SEQ))


def loss_and_grads(model, x, labels):
    model.zero_grad()
    loss = model(input_ids=x, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("make", [dense, lambda: dense(False), moe], ids=["tied", "untied", "moe"])
@pytest.mark.parametrize("chunk", [5, 16, 1000])
def test_chunked_loss_and_gradients_equal_the_plain_ones(make, chunk):
    model = make()
    ref = copy.deepcopy(model)
    chunked_loss.install(model, chunk)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = x.clone()
    labels[0, :5] = -100  # ignored positions count in neither the sum nor the mean
    loss, grads = loss_and_grads(model, x, labels)
    ref_loss, ref_grads = loss_and_grads(ref, x, labels)
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
    for n, gr in ref_grads.items():
        err = ((grads[n] - gr).abs().max() / gr.abs().max().clamp_min(1e-12)).item()
        assert err <= 1e-5, f"{n}: {err:.2e}"
    assert model(input_ids=x).logits.shape == (BATCH, SEQ, VOCAB), "without labels: logits as before"
    chunked_loss.uninstall(model)
    assert torch.equal(model(input_ids=x, labels=labels).loss, ref(input_ids=x, labels=labels).loss)


class LargestLogits(TorchDispatchMode):
    """The most elements of any tensor created with the vocabulary as its last dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            weight_like = t.dim() == 2 and t.shape[0] in (VOCAB, HIDDEN) if isinstance(t, torch.Tensor) else True
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == VOCAB and not weight_like:
                self.largest = max(self.largest, t.numel())
        return out


def test_the_head_never_creates_a_full_logits_tensor():
    x = torch.randint(0, VOCAB, (BATCH, SEQ))
    plain, model = dense(False), dense(False)
    chunked_loss.install(model, 8)
    with LargestLogits() as seen_plain:
        plain(input_ids=x, labels=x).loss.backward()
    assert seen_plain.largest >= BATCH * SEQ * VOCAB  # the check sees full logits where they exist
    with LargestLogits() as seen:
        model(input_ids=x, labels=x).loss.backward()
    assert 0 < seen.largest <= 8 * VOCAB, "at most one chunk of logits at a time"


def test_bad_chunks_are_refused():
    with pytest.raises(ValueError, match="positive"):
        chunked_loss.install(dense(), 0)
    with pytest.raises(ValueError, match="lm_head"):
        chunked_loss.install(torch.nn.Linear(2, 2), 4)
