"""Adapter for transformers decoder-only models, found from the model's own structure (no list of model types).

The block list is the ``nn.ModuleList`` of the decoder (``model.get_decoder()``, else ``model.base_model``) that
holds the most parameters (``model.layers``, ``transformer.h``, ``decoder.layers``, ...), or the one named with
:func:`slidedp_lightning.stream_blocks`. Units (:func:`~slidedp_lightning.models.structure.split_units`): the input
embeddings (``get_input_embeddings()``) and every other module with parameters that the model holds beside its
layers before them, one unit per layer (dense, MoE with stacked experts, routers and shared experts, any attention
kind: whatever a layer holds is its unit), and the final norm with ``get_output_embeddings()`` and the remaining
modules after them. Refused with the reason: encoder-decoder models, models without a block list, and parameters
held directly by a module on the way to the layers.

Weights are initialized with the model's own ``_init_weights`` (module by module, children first, as transformers'
``initialize_weights`` visits them); buffers left on the meta device (rotary frequencies of every kind, embedding
scales, router biases) are recomputed by the same ``_init_weights``, which transformers runs for them too.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn
from transformers import PreTrainedModel

from slidedp_lightning.models.adapter import UnitSpec, UnsupportedModelError, register_adapter
from slidedp_lightning.models.structure import block_path, describe_lists, module_lists, numel, split_units


def blocks_mark(model: nn.Module) -> str | None:
    """The block-list path named with :func:`slidedp_lightning.stream_blocks`, if any."""
    return model.__dict__.get("_slidedp_blocks")


def _decoder(model: PreTrainedModel) -> nn.Module:
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        decoder = None
    return decoder if isinstance(decoder, nn.Module) else model.base_model


def _path_of(model: nn.Module, target: nn.Module) -> str:
    for name, module in model.named_modules():
        if module is target:
            return name
    raise UnsupportedModelError(f"{type(target).__name__} is not a submodule of {type(model).__name__}")


def find_layers(model: PreTrainedModel) -> str:
    """The path of the model's block list (see the module docstring)."""
    marked = blocks_mark(model)
    if marked is not None:
        return marked
    decoder = _decoder(model)
    prefix = _path_of(model, decoder)
    lists = module_lists(decoder)
    if not lists:
        raise UnsupportedModelError(
            f"SlideDP found no block list in {type(model).__name__}: its decoder ({type(decoder).__name__}) holds "
            "no nn.ModuleList of layers. SlideDP streams a model one block at a time; name the blocks with "
            "slidedp_lightning.stream_blocks(model, 'path.to.blocks') or register an adapter with "
            "slidedp_lightning.models.register_adapter."
        )
    name, _ = max(lists, key=lambda item: numel(item[1]))
    return f"{prefix}.{name}" if prefix else name


def _refuse_encoder_decoder(model: PreTrainedModel) -> None:
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        encoder = getattr(model, "get_encoder", lambda: None)()
        what = f" ({type(encoder).__name__})" if isinstance(encoder, nn.Module) else ""
        raise UnsupportedModelError(
            f"SlideDP cannot stream {type(model).__name__}: it is an encoder-decoder model "
            f"(config.is_encoder_decoder){what}. SlideDP streams one list of blocks in forward order; the decoder's "
            "cross-attention needs the encoder's output in every block, across two block lists. Train it with "
            "another strategy (e.g. FSDP)."
        )


@register_adapter
class HFDecoderAdapter:
    """Embedding-side unit, one unit per layer, head-side unit of any transformers decoder-only model."""

    name = "transformers decoder-only models (any family: the layers are found from the model's structure)"

    def __init__(self) -> None:
        self._owners: dict[int, Any] = {}
        self._parents: dict[int, nn.Module] = {}
        self._tree_of: int | None = None

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return isinstance(model, PreTrainedModel)

    def units(self, model: nn.Module) -> list[UnitSpec]:
        assert isinstance(model, PreTrainedModel)  # matches() held
        _refuse_encoder_decoder(model)
        path = block_path(model, find_layers(model))
        if not isinstance(path.blocks, (nn.ModuleList, nn.Sequential)):
            raise UnsupportedModelError(
                f"'{path.path}' of {type(model).__name__} is a {type(path.blocks).__name__}, not a block list "
                f"(nn.ModuleList); its block lists: {describe_lists(model)}."
            )
        first: list[nn.Module] = []
        last: list[nn.Module] = []
        for getter, side in (("get_input_embeddings", first), ("get_output_embeddings", last)):
            try:
                module = getattr(model, getter)()
            except (AttributeError, NotImplementedError):
                module = None
            if isinstance(module, nn.Module):
                side.append(module)
        return split_units(model, path, embed_side=tuple(first), head_side=tuple(last))

    # -- initialization -----------------------------------------------------------------------------------
    def _tree(self, model: nn.Module) -> tuple[dict[int, Any], dict[int, nn.Module]]:
        """Per module: the innermost PreTrainedModel holding it (its ``_init_weights`` initializes it) and its
        parent."""
        if self._tree_of != id(model):
            owners: dict[int, Any] = {}
            parents: dict[int, nn.Module] = {}

            def walk(m: nn.Module, owner: nn.Module) -> None:
                owner = m if isinstance(m, PreTrainedModel) else owner
                owners[id(m)] = owner
                for child in m.children():
                    if id(child) not in owners:
                        parents[id(child)] = m
                        walk(child, owner)

            walk(model, model)
            self._owners, self._parents, self._tree_of = owners, parents, id(model)
        return self._owners, self._parents

    def init_weights(self, model: nn.Module, module: nn.Module) -> None:
        """``module``'s subtree children first, then its ancestors (whose ``_init_weights`` may set a child's
        weights, as GPT-2's scaled residual projections): the draws of transformers' ``initialize_weights`` for the
        materialized modules; every other module is still on the meta device, where an init draws nothing."""
        owners, parents = self._tree(model)
        chain = _post_order(module)
        up = parents.get(id(module))
        while up is not None:
            chain.append(up)
            up = parents.get(id(up))
        for sub in chain:
            owners.get(id(sub), model)._init_weights(sub)

    def materialize_buffers(self, model: nn.Module) -> None:
        for name, module in model.named_modules():
            meta = {b: t for b, t in module._buffers.items() if t is not None and t.is_meta}
            if meta:
                self._recompute(model, name, module, meta)

    def _recompute(self, model: nn.Module, name: str, module: nn.Module, meta: dict[str, torch.Tensor]) -> None:
        """Rebuild ``module``'s meta buffers on CPU with the model's ``_init_weights``; every element must be set."""
        params = {n: p.detach().clone() for n, p in module.named_parameters(recurse=False) if not p.is_meta}
        results: list[dict[str, torch.Tensor]] = []
        with torch.random.fork_rng(devices=[]), torch.no_grad():  # the init of meta parameters draws nothing
            for fill in (math.nan,) if all(t.is_floating_point() for t in meta.values()) else (0, 1):
                for b, t in meta.items():
                    module._buffers[b] = torch.full(t.shape, fill, dtype=t.dtype)
                self._tree(model)[0].get(id(module), model)._init_weights(module)
                results.append({b: cast(torch.Tensor, module._buffers[b]) for b in meta})
            for n, value in params.items():  # materialized parameters keep their values
                getattr(module, n).copy_(value)
        unset = [
            b
            for b in meta
            if (results[0][b].is_floating_point() and results[0][b].isnan().any())
            or any(not torch.equal(results[0][b], r[b]) for r in results[1:])
        ]
        if unset:
            raise UnsupportedModelError(
                f"Buffers {unset} of {name or type(module).__name__} ({type(module).__name__}) are on the meta device "
                f"and {type(model).__name__}._init_weights does not compute them; build the model on CPU "
                "(meta_init=False) or load it with slidedp_lightning.from_pretrained."
            )


def _post_order(module: nn.Module) -> list[nn.Module]:
    """``module``'s submodules, children before their parent (the order of transformers' ``initialize_weights``)."""
    out: list[nn.Module] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            visit(child)
        out.append(m)

    visit(module)
    return out
