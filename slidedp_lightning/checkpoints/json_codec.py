"""Lightning's checkpoint dict as JSON plus named tensors: the metadata of a distributed checkpoint
(:mod:`slidedp_lightning.checkpoints.distributed`), in a form that cannot run code when it is read."""

from __future__ import annotations

from typing import Any

import torch

# tags of the JSON values that stand for what JSON has no form of
_TENSOR, _TUPLE, _ITEMS, _DTYPE = "__tensor__", "__tuple__", "__items__", "__dtype__"
_TAGS = frozenset((_TENSOR, _TUPLE, _ITEMS, _DTYPE))


class CheckpointContentError(TypeError):
    """Something in Lightning's checkpoint has no form in a distributed checkpoint's JSON/tensor metadata."""


def encode(value: Any, tensors: dict[str, torch.Tensor], where: str = "checkpoint") -> Any:
    """``value`` as JSON, its tensors (CPU copies) added to ``tensors`` and referred to by name. Dicts (string
    keys or not), lists, tuples, strings, numbers, booleans, None, dtypes and strided tensors have a form;
    anything else raises :class:`CheckpointContentError` naming ``where`` it is."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_quantized or value.device.type == "meta":
            raise _refused(value, where)
        name = str(len(tensors))
        tensors[name] = value.detach().to("cpu").clone(memory_format=torch.contiguous_format)
        return {_TENSOR: name}
    if isinstance(value, torch.dtype):
        return {_DTYPE: str(value).removeprefix("torch.")}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not _TAGS & value.keys():
            return {k: encode(v, tensors, f"{where}[{k!r}]") for k, v in value.items()}
        return {
            _ITEMS: [
                [encode(k, tensors, f"{where} key {k!r}"), encode(v, tensors, f"{where}[{k!r}]")]
                for k, v in value.items()
            ]
        }
    if isinstance(value, list):
        return [encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if type(value) in (tuple, torch.Size):
        return {_TUPLE: [encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]}
    raise _refused(value, where)


def _refused(value: Any, where: str) -> CheckpointContentError:
    return CheckpointContentError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}: SlideDP's distributed checkpoints "
        "store Lightning's checkpoint as JSON and tensors, never pickled, so that loading one cannot run code, "
        "and this value has no such form. Keep it out of the checkpoint (save_hyperparameters(ignore=[...]), a "
        "callback's state_dict() of plain values), store it as a dict of plain values, or pass "
        "checkpoint_format='full'."
    )


def decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of :func:`encode`."""
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1 and _TAGS & value.keys():
        ((tag, body),) = value.items()
        if tag == _TENSOR:
            return tensors[body]
        if tag == _DTYPE:
            dtype = getattr(torch, body, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype {body!r} in a checkpoint's metadata")
            return dtype
        if tag == _TUPLE:
            return tuple(decode(v, tensors) for v in body)
        return {_hashable(decode(k, tensors)): decode(v, tensors) for k, v in body}
    return {k: decode(v, tensors) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key
