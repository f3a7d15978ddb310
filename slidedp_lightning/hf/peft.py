"""peft in and out of SlideDP: which modules of a model peft injected, the merged weights of its LoRA adapters
(as ``merge_and_unload`` computes them), its adapter configs for a checkpoint's metadata, and its adapters alone in
peft's ``save_pretrained`` layout. peft itself is imported only to write adapters (it is an optional extra)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

# reads tensors by name (keyed as ``model.state_dict()``): from the ledger, or from a checkpoint's shards
Fetch = Callable[[list[str]], dict[str, torch.Tensor]]


def _is_peft(module: nn.Module) -> bool:
    return type(module).__module__.startswith("peft.")


def _lora_layers(model: nn.Module) -> dict[str, Any]:
    """peft's tuner layers of ``model`` (wrapping a base layer), by module name."""
    return {n: m for n, m in model.named_modules() if _is_peft(m) and hasattr(m, "base_layer") and n}


def _saved_wrappers(model: nn.Module) -> dict[str, Any]:
    """peft's ``modules_to_save`` wrappers of ``model`` (a trained copy beside the original), by module name."""
    return {n: m for n, m in model.named_modules() if _is_peft(m) and hasattr(m, "original_module") and n}


def is_peft_model(model: nn.Module) -> bool:
    """Whether peft injected adapters into ``model`` (the transformers model a ``PeftModel`` wraps)."""
    return bool(getattr(model, "peft_config", None)) or bool(_lora_layers(model))


def merged_view(model: nn.Module, meta: dict[str, torch.Tensor], fetch: Fetch) -> tuple[dict[str, torch.Tensor], Fetch]:
    """The export of a peft-injected ``model`` whose tensors (``meta``: shapes, keyed as ``model.state_dict()``)
    ``fetch`` reads: ``(out_meta, read)`` keyed as the model without peft, each LoRA layer's weight merged with
    its active adapters as peft's ``merge_and_unload`` computes it, each ``modules_to_save`` module its trained
    copy. Adapters of another kind are refused (export them with ``adapter_only=True``)."""
    layers, wrappers = _lora_layers(model), _saved_wrappers(model)
    plan: dict[str, tuple[str, list[tuple[str, str, float, bool, bool]]]] = {}  # out -> (source, deltas)
    for name in meta:
        plan[name] = (name, [])
    for prefix, layer in layers.items():
        kind = type(layer).__name__
        active = [a for a in getattr(layer, "active_adapters", []) if a in getattr(layer, "scaling", {})]
        if getattr(layer, "disable_adapters", False) or getattr(layer, "merged", False):
            active = []
        for a in active:
            variant = getattr(layer, "lora_variant", {}).get(a) is not None or getattr(layer, "use_dora", {}).get(a)
            if kind not in ("Linear", "Embedding") or variant or getattr(layer, "lora_bias", {}).get(a):
                raise NotImplementedError(
                    f"SlideDP merges plain LoRA Linear/Embedding adapters; {prefix} is a peft {kind}"
                    f"{' with a LoRA variant (DoRA, ...)' if variant else ''}: export the adapters alone "
                    "(adapter_only=True) and merge them with peft."
                )
        for key in [k for k in plan if k.startswith(prefix + ".")]:
            del plan[key]
        for key in [k for k in meta if k.startswith(prefix + ".base_layer.")]:
            out = prefix + key[len(prefix + ".base_layer") :]
            deltas = []
            if key == f"{prefix}.base_layer.weight":
                for a in active:
                    emb = kind == "Embedding"
                    a_key = f"{prefix}.lora_embedding_A.{a}" if emb else f"{prefix}.lora_A.{a}.weight"
                    b_key = f"{prefix}.lora_embedding_B.{a}" if emb else f"{prefix}.lora_B.{a}.weight"
                    deltas.append((a_key, b_key, float(layer.scaling[a]), emb or bool(layer.fan_in_fan_out), emb))
            plan[out] = (key, deltas)
    for prefix, wrapper in wrappers.items():
        active = [a for a in getattr(wrapper, "active_adapters", []) if a in wrapper.modules_to_save]
        source = f"{prefix}.modules_to_save.{active[0]}." if active else f"{prefix}.original_module."
        for key in [k for k in plan if k.startswith(prefix + ".")]:
            del plan[key]
        for key in [k for k in meta if k.startswith(source)]:
            plan[prefix + "." + key[len(source) :]] = (key, [])
    out_meta = {out: meta[src] for out, (src, _) in plan.items()}

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        wanted = sorted({plan[n][0] for n in names} | {k for n in names for d in plan[n][1] for k in d[:2]})
        got = fetch(wanted)
        out = {}
        for n in names:
            src, deltas = plan[n]
            value = got[src]
            for a_key, b_key, scaling, transpose, _ in deltas:  # peft: weight += transpose(B @ A) * scaling
                delta = got[b_key].float() @ got[a_key].float()
                value = value.float() + (delta.T if transpose else delta) * scaling
            out[n] = value
        return out

    return out_meta, read


def _json_ready(value: Any) -> Any:
    """A peft config's dict as JSON data (sets as sorted lists)."""
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_json_ready(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value.value if hasattr(value, "value") and isinstance(value, str) else value
    return str(value)


def peft_configs(model: nn.Module) -> dict[str, Any]:
    """peft's adapter configs of a peft-injected ``model`` as JSON data (for a checkpoint's metadata), with the
    active adapters; empty for other models."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        return {}
    layers = list(_lora_layers(model).values()) + list(_saved_wrappers(model).values())
    active = list(getattr(layers[0], "active_adapters", [])) if layers else list(configs)[:1]
    return {"peft_config": {a: _json_ready(c.to_dict()) for a, c in configs.items()}, "peft_active": active}


def write_adapters(directory: Path, peft_model: Any, fetch: Fetch, dtype: torch.dtype) -> None:
    """peft's ``save_pretrained`` layout of every adapter of ``peft_model`` (``adapter_model.safetensors`` and
    ``adapter_config.json``; adapters other than ``default`` in a subdirectory of their name), the tensors
    read by ``fetch`` (keyed as the transformers model inside)."""
    from peft.utils import get_peft_model_state_dict

    inner = peft_model.base_model.model
    names = [n for n, _ in inner.state_dict(keep_vars=True).items()]
    for adapter, config in peft_model.peft_config.items():
        wanted = [n for n in names if f".{adapter}." in f"{n}." or n.endswith(f".{adapter}")]
        got = fetch(wanted)
        state = {f"base_model.model.{n}": t for n, t in got.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            adapter_state = get_peft_model_state_dict(
                peft_model, state_dict=state, adapter_name=adapter, save_embedding_layers=False
            )
        where = directory if adapter == "default" else directory / adapter
        where.mkdir(parents=True, exist_ok=True)
        tensors = {
            k: (v.to(dtype) if v.is_floating_point() else v).contiguous().clone() for k, v in adapter_state.items()
        }
        save_file(tensors, str(where / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = copy.copy(config)
        config.inference_mode = True
        config.save_pretrained(str(where))


def peft_wrapper(root: nn.Module, model: nn.Module) -> nn.Module:
    """The ``PeftModel`` of ``root`` that wraps ``model``."""
    for module in root.modules():
        base = getattr(getattr(module, "base_model", None), "model", None)
        if base is model and hasattr(module, "peft_config"):
            return module
    if base := getattr(getattr(root, "base_model", None), "model", None):
        if base is model:
            return root
    raise TypeError(
        f"adapter_only export needs the peft PeftModel that wraps the {type(model).__name__} (get_peft_model); "
        "none was found in the LightningModule."
    )
