"""Adapter for transformers decoder-only causal LMs: Qwen3, Qwen2, Llama, Mistral and Qwen3-MoE (all experts of
a block live in its unit; they are stored as stacked 3-D parameters, so every expert gets a gradient).

All four share the layout ``model.embed_tokens``, ``model.layers[i]``, ``model.norm``, ``lm_head`` and a
rotary embedding module with non-persistent frequency buffers.
"""

from __future__ import annotations

from typing import Protocol, cast

from torch import nn

from slidedp_lightning.models.adapter import UnitSpec, UnsupportedModelError, register_adapter

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral", "qwen3_moe")


class _DecoderStack(Protocol):
    """The base model inside a causal LM (``model.model``)."""

    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module


class _CausalLM(Protocol):
    """The layout :meth:`HFDecoderAdapter.matches` checks, plus transformers' weight initializer."""

    model: _DecoderStack
    lm_head: nn.Linear

    def _init_weights(self, module: nn.Module) -> None: ...


@register_adapter
class HFDecoderAdapter:
    """Embedding unit, one unit per decoder block, and a head unit (final norm + untied ``lm_head``)."""

    name = "transformers causal LM (" + ", ".join(SUPPORTED_MODEL_TYPES) + ")"

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        config = getattr(model, "config", None)
        inner = getattr(model, "model", None)
        return (
            getattr(config, "model_type", None) in SUPPORTED_MODEL_TYPES
            and isinstance(getattr(inner, "layers", None), nn.ModuleList)
            and isinstance(getattr(inner, "embed_tokens", None), nn.Embedding)
            and isinstance(getattr(model, "lm_head", None), nn.Linear)
        )

    def units(self, model: nn.Module) -> list[UnitSpec]:
        lm = cast(_CausalLM, model)  # adapter_for() picked this adapter because matches(model) held
        inner = lm.model
        if len(inner.layers) == 0:
            raise UnsupportedModelError(f"{type(model).__name__} has no decoder layers to stream.")
        units = [UnitSpec("embed", (inner.embed_tokens,))]
        units += [UnitSpec(f"layers.{i}", (layer,), block=True) for i, layer in enumerate(inner.layers)]
        units.append(UnitSpec("head", (inner.norm, lm.lm_head)))
        return units

    def init_weights(self, model: nn.Module, module: nn.Module) -> None:
        lm = cast(_CausalLM, model)
        for sub in module.modules():
            lm._init_weights(sub)

    def materialize_buffers(self, model: nn.Module) -> None:
        for name, module in model.named_modules():
            meta = [b for b, t in module.named_buffers(recurse=False) if t.is_meta]
            if not meta:
                continue
            rope_type = getattr(module, "rope_type", None)
            if rope_type is None or not hasattr(module, "config"):
                raise UnsupportedModelError(
                    f"Buffers {meta} of {name or type(module).__name__} are on the meta device and SlideDP does not "
                    "know how to compute them; build the model on CPU or load it with from_pretrained."
                )
            if rope_type == "default":
                inv_freq, scaling = module.compute_default_rope_parameters(module.config)
            else:
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](module.config)
            module.register_buffer("inv_freq", inv_freq, persistent=False)
            if hasattr(module, "original_inv_freq"):
                module.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)
            module.attention_scaling = scaling
