"""models.segments: a decoder block run segment by segment (and checkpointed per region) is bit-identical."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import transformers
from torch import nn
from torch.utils.checkpoint import checkpoint

from slidedp_lightning.models import UnsupportedModelError
from slidedp_lightning.models.segments import (
    install,
    parse_mask,
    run_segments,
    segments_for,
    uninstall,
)

VOCAB, BATCH, SEQ = 97, 2, 12
# Qwen2/Qwen3: layer 1 uses a sliding window; Mistral: every layer does. Windows shorter than SEQ so they matter.
QWEN_SLIDING = dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)
FAMILIES = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, QWEN_SLIDING),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, QWEN_SLIDING),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=4)),
}
ATTN = ("eager", "sdpa")
CKPT = partial(checkpoint, use_reentrant=False)


def tiny(family: str, attn: str, **overrides) -> nn.Module:
    config_cls, model_cls, extra = FAMILIES[family]
    cfg = config_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=32,
        attn_implementation=attn,
        **{**extra, **overrides},
    )
    torch.manual_seed(0)
    return model_cls(cfg).train()


def batch(padded: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    out = {"input_ids": ids, "labels": ids}
    if padded:  # right padding: no query row is fully masked
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[0, -3:] = 0
        out["attention_mask"] = mask
    return out


def layer_calls(model: nn.Module, padded: bool) -> list[tuple[tuple, dict]]:
    """The exact (args, kwargs) the model passes to each decoder layer in a training forward."""
    calls: list[tuple[tuple, dict]] = []
    hooks = [
        layer.register_forward_pre_hook(lambda m, a, k: calls.append((a, dict(k))), with_kwargs=True)
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(**batch(padded), use_cache=False)
    for h in hooks:
        h.remove()
    return calls


def backward_of(layer: nn.Module, args: tuple, kwargs: dict, forward) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output and gradients (input and every parameter) of ``forward(layer, x, *rest, **kwargs)``."""
    layer.zero_grad(set_to_none=True)
    x = args[0].detach().clone().requires_grad_()
    out = forward(layer, x, *args[1:], **kwargs)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * weight).sum().backward()
    grads = {"<input>": x.grad}
    grads.update({n: p.grad.clone() for n, p in layer.named_parameters()})
    return out.detach(), grads


def plain(layer: nn.Module, *args, **kwargs) -> torch.Tensor:
    return layer(*args, **kwargs)


def segmented(mask: str, checkpoint_fn=None):
    def forward(layer: nn.Module, *args, **kwargs) -> torch.Tensor:
        state, segs = segments_for(layer).segments(layer, args, kwargs)
        return run_segments(segs, state, mask, checkpoint_fn)

    return forward


def assert_same(actual: tuple, expected: tuple, what: str) -> None:
    out, grads = actual
    ref_out, ref_grads = expected
    assert type(out) is type(ref_out) and torch.equal(out, ref_out), f"{what}: output differs"
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert ref_grads[name] is not None and torch.equal(grads[name], ref_grads[name]), f"{what}: grad {name} differs"


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("family", FAMILIES)
def test_segments_in_sequence_match_layer(family: str, attn: str, padded: bool) -> None:
    model = tiny(family, attn)
    for i, (args, kwargs) in enumerate(layer_calls(model, padded)):
        layer = model.model.layers[i]
        ref = backward_of(layer, args, kwargs, plain)
        # A mask of all-kept boundaries with no checkpoint_fn runs the 8 segments one after the other.
        assert_same(backward_of(layer, args, kwargs, segmented("1111111")), ref, f"{family}/{attn} layer {i}")


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("family", FAMILIES)
def test_checkpointed_regions_match_layer(family: str, attn: str) -> None:
    model = tiny(family, attn)
    for i, (args, kwargs) in enumerate(layer_calls(model, padded=True)):
        layer = model.model.layers[i]
        ref = backward_of(layer, args, kwargs, plain)
        for mask in ("0000000", "1111111", "1010101", "0110010"):
            got = backward_of(layer, args, kwargs, segmented(mask, CKPT))
            assert_same(got, ref, f"{family}/{attn} layer {i} mask {mask}")


def test_attention_dropout_is_replayed_exactly() -> None:
    model = tiny("qwen3", "eager", attention_dropout=0.3)
    args, kwargs = layer_calls(model, padded=False)[0]
    layer = model.model.layers[0]
    torch.manual_seed(5)
    ref = backward_of(layer, args, kwargs, plain)
    for mask in ("0000000", "1010101"):
        torch.manual_seed(5)
        assert_same(backward_of(layer, args, kwargs, segmented(mask, CKPT)), ref, f"dropout mask {mask}")
    torch.manual_seed(6)
    assert not torch.equal(backward_of(layer, args, kwargs, plain)[0], ref[0]), "dropout was not active"


def test_regions_follow_kept_boundaries() -> None:
    model = tiny("llama", "eager")
    args, kwargs = layer_calls(model, padded=False)[0]
    layer = model.model.layers[0]
    state, segs = segments_for(layer).segments(layer, args, kwargs)
    arity: list[int] = []

    def recorder(fn, *tensors):
        arity.append(len(tensors))
        return fn(*tensors)

    # Kept boundaries 1, 2, 5: regions [0,1] [2] [3,4,5] [6,7] starting from (h,) (h,q,k,v) (h,a) (h2,gate,up).
    out = run_segments(segs, state, "0110010", recorder)
    assert arity == [1, 4, 2, 3]
    assert torch.equal(out, layer(*args, **kwargs))


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("family", FAMILIES)
def test_whole_model_with_installed_segments(family: str, attn: str) -> None:
    model = tiny(family, attn)
    data = batch(padded=True)

    def loss_and_grads() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = model(**data, use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_loss, ref_grads = loss_and_grads()
    for layer in model.model.layers:
        install(layer, "0101010", CKPT)
    loss, grads = loss_and_grads()
    assert torch.equal(loss, ref_loss)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), f"{family}/{attn}: grad {name} differs"
    for layer in model.model.layers:
        uninstall(layer)
        assert "forward" not in layer.__dict__
    assert torch.equal(loss_and_grads()[0], ref_loss)


def test_unsupported_layer() -> None:
    class MyBlock(nn.Module):
        pass

    with pytest.raises(UnsupportedModelError, match="MyBlock") as err:
        segments_for(MyBlock())
    for needle in ("Qwen3DecoderLayer", "Qwen2DecoderLayer", "LlamaDecoderLayer", "MistralDecoderLayer", "'full'"):
        assert needle in str(err.value)
    with pytest.raises(UnsupportedModelError):
        install(MyBlock(), 0)


def test_cache_is_refused() -> None:
    model = tiny("mistral", "sdpa")
    args, kwargs = layer_calls(model, padded=False)[0]
    layer = model.model.layers[0]
    cache = transformers.DynamicCache(config=model.config)
    for name in ("cache", "past_key_values"):
        with pytest.raises(ValueError, match="use_cache=False"):
            segments_for(layer).segments(layer, args, {**kwargs, name: cache})
    # A training forward with the config's default use_cache=True hands the layers a DynamicCache.
    install(layer, "0000000", CKPT)
    with pytest.raises(ValueError, match="use_cache=False"):
        model(**batch(padded=False))


@pytest.mark.parametrize("bad", ["012", "0101", "01010101", 128, -1, True, [1, 0, 1], [0, 1, 2, 0, 0, 0, 0], 1.5])
def test_bad_masks(bad) -> None:
    with pytest.raises(ValueError, match="segment mask"):
        parse_mask(bad)
    model = tiny("llama", "eager")
    with pytest.raises(ValueError, match="segment mask"):
        install(model.model.layers[0], bad)


def test_mask_forms_agree() -> None:
    assert parse_mask("1000000") == parse_mask(1) == parse_mask([1, 0, 0, 0, 0, 0, 0]) == (True,) + (False,) * 6
    assert parse_mask("0110010") == parse_mask(0b0100110) == parse_mask((False, True, True, False, False, True, False))
    assert parse_mask(127) == parse_mask("1111111")
