"""``slidedp_lightning.from_pretrained``: a Hugging Face checkpoint read straight into the host ledger.

Called in ``LightningModule.configure_model`` under :class:`~slidedp_lightning.SlideDPStrategy`, it returns the model
skeleton on the meta device (``AutoConfig`` + ``AutoModelForCausalLM.from_config`` in FP32) with the checkpoint
attached as the source of the ledger's initial weights: no rank ever holds the full model. At setup every local
rank reads a balanced share of the units from the safetensors files into the shared FP32 master (tensor by tensor,
memory-mapped) and writes their BF16 copy; every host reads from its own disk.

Key names follow transformers' loading exactly (its renamings and ``base_model_prefix`` handling, its tied-weight
rules); a checkpoint that needs one of transformers' tensor conversions at load (e.g. per-expert MoE weights
stacked) is refused. Everything is checked here, on every rank, from the file headers only: missing, unexpected
or mismatched tensors and unreadable or truncated files raise :class:`CheckpointError` before any ledger exists.

Outside a SlideDP strategy it is ``AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
local_files_only=True, **kwargs)``.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Generator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from slidedp_lightning.models.adapter import UnsupportedModelError
from slidedp_lightning.runtime.engine import find_streamed_model
from slidedp_lightning.runtime.host_os import format_bytes
from slidedp_lightning.runtime.ledger.weight_source import (
    INITIAL_VALUES_ATTR,
    WEIGHT_SOURCE_ATTR,
    CheckpointError,
    SafetensorsWeights,
    StoredTensor,
    checkpoint_files,
    scan_safetensors,
)
from slidedp_lightning.runtime.topology import Topology

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["CheckpointError", "from_pretrained", "loading_into_ledger", "warn_if_materialized"]

log = logging.getLogger(__name__)

_INTO_LEDGER: ContextVar[bool] = ContextVar("slidedp_into_ledger", default=False)
_STREAMED = "_slidedp_streamed"  # set on a model once an engine has taken it
# from_pretrained options about where and how to place or fetch the weights, which the ledger decides or the local
# directory makes moot
_REFUSED = (
    "device_map",
    "max_memory",
    "offload_folder",
    "offload_buffers",
    "quantization_config",
    "gguf_file",
    "tp_plan",
    "tp_size",
    "device_mesh",
    "distributed_config",
    "state_dict",
    "variant",
    "subfolder",
    "use_kernels",
    "kernel_config",
    "adapter_kwargs",
    "adapter_name",
    "output_loading_info",
    "revision",
    "token",
    "cache_dir",
    "proxies",
    "force_download",
)
_IGNORED = ("low_cpu_mem_usage", "_fast_init", "use_safetensors")  # transformers ignores the first two too


@contextmanager
def loading_into_ledger() -> Generator[None, None, None]:
    """Within it, :func:`from_pretrained` returns a meta skeleton whose weights the SlideDP engine reads into the
    ledger (entered by the strategy around ``configure_model``). The values peft draws for the adapters it adds
    to such a skeleton are recorded as it creates them (it then moves them to the base layer's meta device), so
    that they, as in a run without SlideDP, are the adapters' initial weights."""
    from torch.nn.modules.module import (
        register_module_module_registration_hook,
        register_module_parameter_registration_hook,
    )

    token = _INTO_LEDGER.set(True)
    hooks = [
        register_module_module_registration_hook(_record_adapter),
        register_module_parameter_registration_hook(_record_adapter),
    ]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        _INTO_LEDGER.reset(token)


_ADAPTER_CONTAINER = "_slidedp_adapter_container"


def _record_adapter(module: nn.Module, name: str, value: Any) -> None:
    """Registration hook: mark peft's adapter containers (``lora_A``, ...) and record the CPU values of what is
    added to one (a small adapter module or parameter), under :data:`INITIAL_VALUES_ATTR` of its owner."""
    if type(module).__module__.startswith("peft.") and name in (
        *getattr(module, "adapter_layer_names", ()),
        *getattr(module, "other_param_names", ()),
    ):
        if isinstance(value, nn.Module):
            value.__dict__[_ADAPTER_CONTAINER] = True
        return
    if not module.__dict__.get(_ADAPTER_CONTAINER) or value is None:
        return
    if isinstance(value, nn.Module):
        for owner in value.modules():
            found = {k: p for k, p in owner._parameters.items() if p is not None and not p.is_meta}
            if found:
                owner.__dict__.setdefault(INITIAL_VALUES_ATTR, {}).update(found)
    elif isinstance(value, torch.Tensor) and not value.is_meta:
        module.__dict__.setdefault(INITIAL_VALUES_ATTR, {})[name] = value


def from_pretrained(path: str | os.PathLike, **kwargs: Any) -> nn.Module:
    """A causal LM from a local ``save_pretrained`` directory: under SlideDP, its skeleton on the meta device with
    the checkpoint attached (read into the ledger at setup, never whole on any rank); elsewhere transformers'
    ``AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True, **kwargs)``.

    ``kwargs``: config overrides and model options as transformers takes them (``attn_implementation=...``,
    ``key_mapping=...``); options that place or fetch weights (``device_map``, quantization, ...) are refused.
    Raises :class:`CheckpointError` naming the tensors or the file when the checkpoint does not match the model.
    """
    from transformers import AutoModelForCausalLM

    if not _INTO_LEDGER.get():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True, **kwargs)
    directory = os.fspath(path)
    if not os.path.isdir(directory):
        raise CheckpointError(
            f"{directory!r} is not a local directory: slidedp_lightning.from_pretrained reads a save_pretrained "
            "directory from local disk and downloads nothing (fetch a hub model first, e.g. "
            f"`huggingface-cli download {directory} --local-dir DIR`, and pass DIR)."
        )
    model = _skeleton(directory, dict(kwargs))
    files = checkpoint_files(directory)
    stored = scan_safetensors(directory)
    tensors, buffers = _match(model, stored, kwargs.get("key_mapping"))
    dtypes = sorted({t.dtype for t in tensors.values()})
    size = sum(t.numel * t.itemsize for t in {id(t): t for t in tensors.values()}.values())
    source = SafetensorsWeights(
        tensors, f"checkpoint {directory} ({len(files)} file(s), {format_bytes(size)} {'/'.join(dtypes)})"
    )
    _load_buffers(model, buffers)
    setattr(model, WEIGHT_SOURCE_ATTR, source)
    return model


def _skeleton(directory: str, kwargs: dict[str, Any]) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_config`` on the meta device in FP32, configured as from_pretrained would."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PretrainedConfig

    for name in ("dtype", "torch_dtype", "local_files_only"):
        if name in kwargs:
            raise TypeError(
                f"slidedp_lightning.from_pretrained sets {name} itself (an FP32 master, local files only): drop it."
            )
    refused = sorted(k for k in kwargs if k in _REFUSED)
    if refused or kwargs.get("use_safetensors") is False:
        raise TypeError(
            f"slidedp_lightning.from_pretrained under SlideDP does not take {refused or ['use_safetensors=False']}: "
            "the weights go to the host ledger from a local safetensors directory. Load with transformers' "
            "from_pretrained (every rank holds the full model) if you need them."
        )
    for name in _IGNORED:
        kwargs.pop(name, None)
    kwargs.pop("key_mapping", None)
    model_kwargs = {k: kwargs.pop(k) for k in ("attn_implementation", "experts_implementation") if k in kwargs}
    config = kwargs.pop("config", None)
    if not isinstance(config, PretrainedConfig):
        config, unused = AutoConfig.from_pretrained(
            directory if config is None else config, return_unused_kwargs=True, local_files_only=True, **kwargs
        )
        kwargs = unused
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **model_kwargs, **kwargs)
    if os.path.isfile(os.path.join(directory, "generation_config.json")):
        try:
            model.generation_config = GenerationConfig.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError) as err:  # transformers keeps the default one too
            log.warning("SlideDP: %s/generation_config.json not read (%s); using the default", directory, err)
    model.eval()  # as from_pretrained returns it
    return model


def _match(
    model: PreTrainedModel, stored: dict[str, StoredTensor], key_mapping: dict | None
) -> tuple[dict[str, StoredTensor], dict[str, StoredTensor]]:
    """Every parameter name of ``model`` (tied names included), and every persistent buffer the checkpoint holds
    -> the stored tensor it loads, by transformers' rules; raises for conversions, unexpected, missing and
    mismatched tensors."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model, key_mapping, None)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    expected = model.state_dict()  # parameters and persistent buffers, on meta
    prefix: str = model.base_model_prefix
    by_name: dict[str, StoredTensor] = {}
    unexpected: list[str] = []
    converted: list[tuple[str, str]] = []
    for key in sorted(stored):
        name, pattern = rename_source_key(key, renamings, converters, prefix, expected)
        if name not in expected and key in expected:  # as transformers: no renaming, only the prefix
            name, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=expected)
        if pattern is not None:
            converted.append((key, pattern))
        elif name not in expected:
            unexpected.append(key)
        elif name in by_name:
            raise CheckpointError(f"tensors {by_name[name].key!r} and {key!r} both load {name!r}")
        else:
            by_name[name] = stored[key]
    model_type = getattr(model.config, "model_type", type(model).__name__)
    if converted:
        key, pattern = converted[0]
        raise CheckpointError(
            f"{model_type} checkpoints need a tensor conversion at load in transformers ({len(converted)} tensor(s) "
            f"match {pattern!r}, e.g. {key!r}), which SlideDP does not reproduce tensor by tensor: load this model with "
            "transformers' from_pretrained in configure_model for now (every rank holds the full FP32 model)."
        )
    unexpected = _not_ignored(model, unexpected)
    _tie(model, by_name)
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [n for n in params if n not in by_name]
    mismatched = [
        f"{n}: stored {list(by_name[n].shape)} ({by_name[n].key}), model {list(p.shape)}"
        for n, p in params.items()
        if n in by_name and tuple(by_name[n].shape) != tuple(p.shape)
    ]
    if missing or unexpected or mismatched:
        where = os.path.dirname(next(iter(stored.values())).file) if stored else "the checkpoint"
        raise CheckpointError(
            f"{where} does not match {type(model).__name__} ({model_type})"
            + (f"; missing {len(missing)} tensor(s): {missing[:8]}" if missing else "")
            + (f"; {len(unexpected)} unexpected tensor(s): {unexpected[:8]}" if unexpected else "")
            + (f"; shape mismatch: {mismatched[:8]}" if mismatched else "")
            + ". Is the config.json the one the weights were saved with?"
        )
    buffers = {n: t for n, t in by_name.items() if n not in params}
    return {n: by_name[n] for n in params}, buffers


def _not_ignored(model: nn.Module, keys: list[str]) -> list[str]:
    """The unexpected keys transformers would not drop silently (its ignore patterns, old rotary/position buffers)."""
    patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    buffers = [b for b, _ in model.named_buffers()]
    if any(b.endswith("rotary_emb.inv_freq") for b in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(b.endswith("position_ids") for b in buffers):
        patterns.add(r"(^|\.)position_ids$")
    if not patterns:
        return keys
    ignore = re.compile("|".join(f"({p})" for p in patterns))
    return [k for k in keys if ignore.search(k) is None]


def _tie(model: nn.Module, by_name: dict[str, StoredTensor]) -> None:
    """transformers' tied-weight rules at load: a tied parameter loads from whichever of its names is stored; both
    stored with different values (the config is wrong) unties them, with transformers' warning."""
    tied: dict[str, str] = getattr(model, "all_tied_weights_keys", None) or {}
    for target, source in list(tied.items()):
        has_target, has_source = target in by_name, source in by_name
        if has_target and has_source:
            pair = SafetensorsWeights({"a": by_name[source], "b": by_name[target]}, "tied pair")
            try:
                same = pair.equal("a", "b")
            finally:
                pair.close()
            if same:
                continue
            log.warning(
                "The tied weights mapping and config for this model specifies to tie %s to %s, but both are present "
                "in the checkpoints with different values, so we will NOT tie them. You should update the config "
                "with `tie_word_embeddings=False` to silence this warning.",
                source,
                target,
            )
            tied.pop(target)
            parent, _, attr = target.rpartition(".")
            module = model.get_submodule(parent)
            old = getattr(module, attr)
            setattr(module, attr, nn.Parameter(torch.empty_like(old, device="meta"), old.requires_grad))
        elif has_target:
            by_name[source] = by_name[target]
        elif has_source:
            by_name[target] = by_name[source]


def _load_buffers(model: nn.Module, buffers: dict[str, StoredTensor]) -> None:
    """Persistent buffers held by the checkpoint are small: read them now (FP32 if floating), on every rank."""
    from safetensors import safe_open

    for name, t in buffers.items():
        with safe_open(t.file, framework="pt", device="cpu") as f:
            value = f.get_tensor(t.key)
        parent, _, attr = name.rpartition(".")
        model.get_submodule(parent)._buffers[attr] = value.float() if value.is_floating_point() else value


def warn_if_materialized(root: nn.Module, topology: Topology) -> None:
    """The naive path: warn once (global rank 0) when a model with its weights materialized on every rank comes to
    its first SlideDP engine of a multi-rank job. Weights given back by an earlier run on the same model are not
    warned about."""
    try:
        model = find_streamed_model(root)
    except UnsupportedModelError:
        return  # the engine says why
    seen = getattr(model, _STREAMED, False)
    model.__dict__[_STREAMED] = True
    params = list({id(p): p for p in model.parameters()}.values())
    if seen or topology.world_size == 1 or topology.global_rank != 0 or not params:
        return
    if any(p.is_meta for p in params):
        return  # meta_init, or slidedp_lightning.from_pretrained
    nbytes = sum(p.numel() for p in params) * 4
    ranks = topology.ranks_per_host
    log.warning(
        "SlideDP: the model arrived with its weights materialized on every rank: %d ranks x %s of FP32 = "
        "%s of host memory per host on top of the ledger, before local rank 0's copy goes in (the ranks "
        "that do not write the ledger free theirs first). Load a checkpoint with "
        "`slidedp_lightning.from_pretrained(path)` in configure_model instead (read straight into the ledger), or "
        "build random weights with SlideDPStrategy(meta_init=True).",
        ranks,
        format_bytes(nbytes),
        format_bytes(ranks * nbytes),
    )
