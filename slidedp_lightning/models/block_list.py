"""User models with a block list (nanoGPT/LitGPT-style, not from transformers).

A model streams when it has a list of blocks: found automatically when unambiguous (exactly one ``nn.ModuleList``
or ``nn.ModuleDict``, torchtitan's form, whose children are all of one class and hold more than half of the model's
parameters), or named with :func:`stream_blocks`::

    model = slidedp_lightning.stream_blocks(GPT(config), "transformer.h")

Parameters outside the blocks form an embedding-side and a head-side unit
(:func:`~slidedp_lightning.models.structure.split_units`); tied weights (nanoGPT ties ``wte`` and ``lm_head``)
live in the first unit that holds them. Such models have no ``_init_weights``: under ``meta_init`` every module that
owns parameters is initialized by its own ``reset_parameters()`` (PyTorch's default initialization), and a model
with a parameter-owning module that has none, or with buffers on the meta device, is refused before any ledger is
created.
"""

from __future__ import annotations

from torch import nn

from slidedp_lightning.models.adapter import UnitSpec, UnsupportedModelError
from slidedp_lightning.models.hf_decoder import blocks_mark
from slidedp_lightning.models.structure import block_path, describe_lists, members, module_lists, numel, split_units

HOW_TO_NAME = (
    "Name the blocks with slidedp_lightning.stream_blocks(model, 'path.to.blocks') (the dotted path of the "
    "nn.ModuleList of blocks, e.g. 'transformer.h'), or register an adapter with "
    "slidedp_lightning.models.register_adapter."
)


def stream_blocks(model: nn.Module, path: str) -> nn.Module:
    """Tell SlideDP that ``model`` streams one block of ``model.<path>`` (an ``nn.ModuleList``, or an
    ``nn.ModuleDict`` in insertion order) at a time; returns ``model``. Any strategy accepts the marked model; SlideDP reads the mark when it builds its units."""
    if not isinstance(path, str) or not path:
        raise TypeError(f"stream_blocks needs the dotted path of the block list, e.g. 'transformer.h'; got {path!r}")
    try:
        found = block_path(model, path)
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"{err} Its block lists: {describe_lists(model)}.") from None
    if not isinstance(found.blocks, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) or not len(found.blocks):
        raise UnsupportedModelError(
            f"'{path}' of {type(model).__name__} is a {type(found.blocks).__name__}, not a non-empty list of blocks "
            f"(nn.ModuleList or nn.ModuleDict); its block lists: {describe_lists(model)}."
        )
    model.__dict__["_slidedp_blocks"] = path
    return model


def detect_blocks(model: nn.Module) -> str:
    """The path of ``model``'s unambiguous block list, or :class:`UnsupportedModelError` saying why there is none."""
    total = numel(model)
    homogeneous = [
        (name, blocks)
        for name, blocks in module_lists(model, dicts=True)
        if len({type(b) for b in members(blocks)}) == 1 and len(blocks)
    ]
    major = [(name, blocks) for name, blocks in homogeneous if 2 * numel(blocks) > total]
    if len(major) == 1:
        return major[0][0]
    lists = describe_lists(model)
    if lists == "none":
        why = "it holds no nn.ModuleList or nn.ModuleDict of blocks"
    else:
        why = (
            "no nn.ModuleList or nn.ModuleDict of blocks of one class holds more than half of its parameters, so the "
            "block list is "
            f"ambiguous (its lists: {lists})"
        )
    raise UnsupportedModelError(
        f"SlideDP found no block list in {type(model).__name__}: {why}. SlideDP streams a model one block at a "
        f"time. {HOW_TO_NAME}"
    )


class BlockListAdapter:
    """Embedding-side unit, one unit per block, head-side unit of a model with a block list."""

    name = "models with a block list (found when unambiguous, or named with slidedp_lightning.stream_blocks)"

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        """Marked with :func:`stream_blocks`, or with an unambiguous block list."""
        if blocks_mark(model) is not None:
            return True
        try:
            detect_blocks(model)
        except UnsupportedModelError:
            return False
        return True

    def units(self, model: nn.Module) -> list[UnitSpec]:
        path = block_path(model, blocks_mark(model) or detect_blocks(model))
        specs = split_units(model, path)
        if any(p.is_meta for p in model.parameters()):
            self._check_meta_init(model)
        return specs

    def _check_meta_init(self, model: nn.Module) -> None:
        """Under meta_init every parameter owner needs ``reset_parameters``; no buffer may be on the meta device."""
        for name, module in model.named_modules():
            if next(module.parameters(recurse=False), None) is not None and not callable(
                getattr(module, "reset_parameters", None)
            ):
                raise UnsupportedModelError(
                    f"{type(model).__name__} is on the meta device, but {name or 'the model'} "
                    f"({type(module).__name__}) owns parameters and has no reset_parameters(): SlideDP initializes "
                    "the meta modules of a model without transformers' _init_weights by calling their "
                    "reset_parameters(). Define it, or build the model on CPU (meta_init=False)."
                )
        self.materialize_buffers(model)

    def init_weights(self, model: nn.Module, module: nn.Module) -> None:
        for sub in module.modules():
            if next(sub.parameters(recurse=False), None) is not None:
                sub.reset_parameters()  # type: ignore[operator]  # checked by units()

    def materialize_buffers(self, model: nn.Module) -> None:
        meta = [name for name, b in model.named_buffers() if b.is_meta]
        if meta:
            raise UnsupportedModelError(
                f"Buffers {meta[:4]} of {type(model).__name__} are on the meta device and SlideDP cannot recompute "
                "the buffers of a model without transformers' _init_weights; build the model on CPU "
                "(meta_init=False), or create these buffers in forward."
            )
