"""Segment-level forward of one decoder block, for segment-level activation checkpointing.

A decoder block runs as 8 segments with 7 internal boundaries::

    0 input norm | 1 QKV projections (+ q/k norm, rotary) | 2 attention core | 3 output projection + residual
    4 post-attention norm | 5 gate/up projections | 6 activation x up | 7 down projection + residual

Each segment maps a *boundary state* (a tuple of tensors) to the next one:

    input (h,) -> 0 -> (h, x) -> 1 -> (h, q, k, v) -> 2 -> (h, a) -> 3 -> (h2,) -> 4 -> (h2, x2)
    -> 5 -> (h2, gate, up) -> 6 -> (h2, m) -> 7 -> output tensor (what the layer's forward returns)

**Mask convention.** A mask says at which internal boundary (boundary ``i`` lies between segment ``i`` and
``i + 1``) the state is kept; the segments between two kept boundaries form one region, run through
``checkpoint_fn`` (recomputed in backward from its input state). Accepted forms, all meaning the same:

- a 7-character string of ``0``/``1``, read left to right as boundary 0..6 (``"1000000"`` keeps boundary 0);
- an ``int`` in ``[0, 128)`` whose bit ``i`` (``1 << i``) is boundary ``i`` (so ``"1000000"`` == ``1``);
- a sequence of 7 booleans (or 0/1), element ``i`` for boundary ``i``.

``"0000000"`` is one region (full-layer checkpointing); ``"1111111"`` checkpoints every segment by itself.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

from slidedp_lightning.models.adapter import UnsupportedModelError

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

log = logging.getLogger(__name__)

NUM_SEGMENTS = 8
NUM_BOUNDARIES = NUM_SEGMENTS - 1
State = torch.Tensor | tuple[torch.Tensor, ...]
Segment = Callable[..., State]
Mask = int | str | Sequence[bool | int]
CheckpointFn = Callable[..., State]

# Positional order of the decoder layer's forward parameters (transformers 5.x).
_LAYER_PARAMS = ("hidden_states", "attention_mask", "position_ids", "cache", "use_cache", "position_embeddings")


class AttentionLayout(Protocol):
    """The attention submodule of a supported decoder layer (transformers' Llama layout)."""

    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    head_dim: int
    scaling: float
    attention_dropout: float
    training: bool
    config: PreTrainedConfig


class QKNormAttentionLayout(AttentionLayout, Protocol):
    """Qwen3 attention: RMSNorm over the head dim of q and k."""

    q_norm: nn.Module
    k_norm: nn.Module


class SlidingWindowAttentionLayout(AttentionLayout, Protocol):
    """Qwen2/Qwen3 attention: a per-layer sliding window (None on full-attention layers)."""

    sliding_window: int | None


class MLPLayout(Protocol):
    """The gated MLP submodule of a supported decoder layer."""

    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module
    act_fn: Callable[[torch.Tensor], torch.Tensor]


class DecoderLayerLayout(Protocol):
    """The submodules of a decoder layer that :class:`BlockSegments` runs."""

    self_attn: AttentionLayout
    mlp: MLPLayout
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module


class BlockSegments:
    """How to run one family of decoder layers segment by segment (Llama layout; subclasses adjust)."""

    qk_norm = False  # Qwen3: RMSNorm over the head dim of q and k before rotary

    def attention_extra(self, attn: AttentionLayout) -> dict[str, Any]:
        """Extra keyword arguments the attention module passes to the attention function."""
        return {}

    def segments(self, layer: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[State, list[Segment]]:
        """Bind a layer call (args/kwargs as the model passes them) to its input state and its 8 segments."""
        if len(args) > len(_LAYER_PARAMS):
            raise TypeError(f"{type(layer).__name__}.forward takes at most {len(_LAYER_PARAMS)} positional arguments")
        call = dict(zip(_LAYER_PARAMS, args))
        for name, value in kwargs.items():
            if name in call:
                raise TypeError(f"{type(layer).__name__}.forward got multiple values for argument {name!r}")
            call[name] = value
        for name in ("cache", "past_key_values", "layer_past"):
            if call.pop(name, None) is not None:
                raise ValueError(
                    f"segment-level checkpointing of {type(layer).__name__} got a KV cache ({name}=...): it runs "
                    "training forwards only; call the model with use_cache=False."
                )
        hidden = call.pop("hidden_states")
        mask = call.pop("attention_mask", None)
        rotary = call.pop("position_embeddings", None)
        if rotary is None:
            raise ValueError(f"{type(layer).__name__} needs position_embeddings=(cos, sin) from the model")
        cos, sin = rotary
        # What the attention module forwards to the attention function besides its named arguments.
        extra = {"position_ids": call.pop("position_ids", None), "use_cache": call.pop("use_cache", False), **call}

        # segments_for() serves only registered layer classes, all of this layout
        block = cast(DecoderLayerLayout, layer)
        attn, mlp = block.self_attn, block.mlp
        modeling = sys.modules[type(attn).__module__]
        q_norm: nn.Module | None = None
        k_norm: nn.Module | None = None
        if self.qk_norm:
            normed = cast(QKNormAttentionLayout, attn)
            q_norm, k_norm = normed.q_norm, normed.k_norm

        def project(proj: nn.Module, norm: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
            y = proj(x).view(*x.shape[:-1], -1, attn.head_dim)
            return (y if norm is None else norm(y)).transpose(1, 2)

        def s0_input_norm(h: torch.Tensor) -> State:
            return h, block.input_layernorm(h)

        def s1_qkv(h: torch.Tensor, x: torch.Tensor) -> State:
            q, k = project(attn.q_proj, q_norm, x), project(attn.k_proj, k_norm, x)
            v = project(attn.v_proj, None, x)
            q, k = modeling.apply_rotary_pos_emb(q, k, cos, sin)
            return h, q, k, v

        def s2_attention(h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> State:
            impl = attn.config._attn_implementation
            fn = ALL_ATTENTION_FUNCTIONS.get_interface(impl, modeling.eager_attention_forward)
            out, _ = fn(
                attn,
                q,
                k,
                v,
                mask,
                dropout=0.0 if not attn.training else attn.attention_dropout,
                scaling=attn.scaling,
                **self.attention_extra(attn),
                **extra,
            )
            return h, out.reshape(*h.shape[:-1], -1).contiguous()

        def s3_out_proj(h: torch.Tensor, a: torch.Tensor) -> State:
            return (h + attn.o_proj(a),)

        def s4_post_norm(h: torch.Tensor) -> State:
            return h, block.post_attention_layernorm(h)

        def s5_gate_up(h: torch.Tensor, x: torch.Tensor) -> State:
            return h, mlp.gate_proj(x), mlp.up_proj(x)

        def s6_act(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> State:
            return h, mlp.act_fn(gate) * up

        def s7_down_proj(h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            return h + mlp.down_proj(m)

        segs: list[Segment] = [
            s0_input_norm,
            s1_qkv,
            s2_attention,
            s3_out_proj,
            s4_post_norm,
            s5_gate_up,
            s6_act,
            s7_down_proj,
        ]
        return (hidden,), segs


_SEGMENTS: dict[type, type[BlockSegments]] = {}


def register_segments(*layer_classes: type) -> Callable[[type[BlockSegments]], type[BlockSegments]]:
    """Class decorator: make a :class:`BlockSegments` implementation serve ``layer_classes``."""

    def decorator(cls: type[BlockSegments]) -> type[BlockSegments]:
        for layer_cls in layer_classes:
            _SEGMENTS[layer_cls] = cls
        return cls

    return decorator


@register_segments(LlamaDecoderLayer)
class LlamaSegments(BlockSegments):
    """Llama: no sliding window, optional q/k/v/o bias (handled by the Linear modules)."""


@register_segments(Qwen2DecoderLayer)
class Qwen2Segments(BlockSegments):
    """Qwen2: q/k/v bias; per-layer sliding window."""

    def attention_extra(self, attn: AttentionLayout) -> dict[str, Any]:
        return {"sliding_window": cast(SlidingWindowAttentionLayout, attn).sliding_window}


@register_segments(Qwen3DecoderLayer)
class Qwen3Segments(Qwen2Segments):
    """Qwen3: q_norm/k_norm over the head dim; per-layer sliding window."""

    qk_norm = True


@register_segments(MistralDecoderLayer)
class MistralSegments(BlockSegments):
    """Mistral: the config's sliding window on every layer."""

    def attention_extra(self, attn: AttentionLayout) -> dict[str, Any]:
        return {"sliding_window": getattr(attn.config, "sliding_window", None)}


def segments_for(layer: nn.Module) -> BlockSegments:
    """The segment implementation for ``layer``'s class, or :class:`UnsupportedModelError`."""
    cls = _SEGMENTS.get(type(layer))
    if cls is None:
        known = ", ".join(sorted(c.__name__ for c in _SEGMENTS))
        raise UnsupportedModelError(
            f"segment-level activation checkpointing does not know {type(layer).__name__}; supported decoder "
            f"layers: {known}. activation_policy='full', 'selective' and 'none' still work for it."
        )
    return cls()


def parse_mask(mask: Mask) -> tuple[bool, ...]:
    """Normalize a mask (see the module docstring) to 7 booleans, boundary 0 first."""
    if isinstance(mask, bool):
        raise ValueError(f"segment mask must be an int, a 7-character 0/1 string or 7 booleans, got {mask!r}")
    if isinstance(mask, int):
        if not 0 <= mask < 1 << NUM_BOUNDARIES:
            raise ValueError(f"segment mask int must be in [0, {1 << NUM_BOUNDARIES}), got {mask}")
        return tuple(bool(mask >> i & 1) for i in range(NUM_BOUNDARIES))
    if isinstance(mask, str):
        if len(mask) != NUM_BOUNDARIES or set(mask) - {"0", "1"}:
            raise ValueError(f"segment mask string must be {NUM_BOUNDARIES} characters of 0/1, got {mask!r}")
        return tuple(c == "1" for c in mask)
    try:
        bits = tuple(mask)
    except TypeError:
        raise ValueError(f"segment mask must be an int, a 7-character 0/1 string or 7 booleans, got {mask!r}") from None
    if len(bits) != NUM_BOUNDARIES or any(b not in (0, 1) for b in bits):
        raise ValueError(f"segment mask sequence must hold {NUM_BOUNDARIES} booleans or 0/1, got {mask!r}")
    return tuple(bool(b) for b in bits)


def _as_args(state: State) -> tuple[torch.Tensor, ...]:
    return (state,) if isinstance(state, torch.Tensor) else tuple(state)


def _chain(segs: Sequence[Segment]) -> Segment:
    def region(*state: torch.Tensor) -> State:
        out: State = state
        for seg in segs:
            out = seg(*_as_args(out))
        return out

    return region


def run_segments(segs: Sequence[Segment], state: State, mask: Mask, checkpoint_fn: CheckpointFn | None = None) -> State:
    """Run ``segs`` from ``state``, each region between kept boundaries as ``checkpoint_fn(region, *state)``.

    ``checkpoint_fn`` is e.g. ``partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)``; ``None`` runs
    the plain forward. Returns the last segment's output.
    """
    if len(segs) != NUM_SEGMENTS:
        raise ValueError(f"expected {NUM_SEGMENTS} segments, got {len(segs)}")
    keep = parse_mask(mask)
    run = checkpoint_fn or (lambda fn, *args: fn(*args))
    ends = [i + 1 for i, kept in enumerate(keep) if kept] + [NUM_SEGMENTS]
    start = 0
    for end in ends:
        state = run(_chain(segs[start:end]), *_as_args(state))
        start = end
    return state


def install(layer: nn.Module, mask: Mask, checkpoint_fn: CheckpointFn | None = None) -> None:
    """Replace ``layer``'s forward by the segmented one under ``mask``; :func:`uninstall` restores it.

    The instance-level forward bypasses transformers' own per-layer gradient checkpointing for this layer.
    """
    impl, keep = segments_for(layer), parse_mask(mask)
    uninstall(layer)

    def forward(*args: Any, **kwargs: Any) -> State:
        state, segs = impl.segments(layer, args, kwargs)
        return run_segments(segs, state, keep, checkpoint_fn)

    forward.slidedp_segment_mask = keep  # type: ignore[attr-defined]
    layer.forward = forward
    log.debug("segmented forward installed on %s, mask %s", type(layer).__name__, keep)


def uninstall(layer: nn.Module) -> None:
    """Restore the class forward of ``layer`` if :func:`install` replaced it; otherwise do nothing."""
    if hasattr(layer.__dict__.get("forward"), "slidedp_segment_mask"):
        del layer.forward
