"""Hugging Face export: a ``save_pretrained`` directory (safetensors + config), straight from the host ledger
or, offline, from a distributed checkpoint (any host layout).

The weights never go through a device or a whole-model copy: one safetensors shard at a time is converted
from the FP32 master (BF16 or FP32) and written by global rank 0 (offline: read from the checkpoint shard by
shard); a tied weight is written once, under its first name, as ``save_pretrained`` does.

Every export is written into a hidden sibling directory and swapped into place as the checkpoints are
(:mod:`slidedp_lightning.checkpoints.distributed`): an interrupted one leaves the previous directory whole, and the files of an
earlier model there (another shard count, an index, an adapter) never mix with the new ones. Into an existing
model directory the weight files and configs are replaced as a whole; its other files (tokenizer, README, periodic
``step=<n>`` exports) are kept; a directory holding anything else is refused.

A peft model (LoRA) exports as the merged full model (``W + scaling * B @ A``, as ``merge_and_unload``), which
transformers loads without peft; ``adapter_only=True`` writes the adapters alone in peft's format
(``PeftModel.from_pretrained`` loads them onto the base model).

Offline: ``python -m slidedp_lightning.export CHECKPOINT_DIR OUT_DIR [--dtype bf16|fp32] [--config HF_DIR]
[--adapter-only]``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import threading
import warnings
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from torch import nn

from slidedp_lightning.checkpoints import distributed as sharded
from slidedp_lightning.checkpoints import files as checkpoint_files
from slidedp_lightning.hf.peft import Fetch, is_peft_model, merged_view, peft_wrapper, write_adapters

if TYPE_CHECKING:
    from slidedp_lightning.checkpoints.engine_view import EngineView

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
# what an export writes or replaces as a whole; everything else of a model directory (tokenizer, README, ...) stays
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".index.json")
_REPLACED = ("config.json", "generation_config.json", "adapter_config.json")


def export_bytes(meta: dict[str, torch.Tensor], dtype: torch.dtype) -> int:
    """About the bytes of an export of the tensors ``meta`` (shapes and dtypes) in ``dtype``."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(t.numel() * (size if t.is_floating_point() else t.element_size()) for t in meta.values())


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"export dtype must be bfloat16 or float32, got {dtype!r}.")
    return dtype


# -- where an export goes -----------------------------------------------------------------------------------


def _replaced(name: str) -> bool:
    return name in _REPLACED or name.endswith(_WEIGHT_SUFFIXES)


def check_export_target(directory: str | os.PathLike) -> Path:
    """Where an export to ``directory`` goes (a symbolic link's target); raises, in one line naming the cause
    and the fix, when it cannot be written there: a file, a directory holding something other than a model, or
    a parent that cannot be written."""
    path = checkpoint_files.write_target(Path(directory).absolute())
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"export target {path} exists and is not a directory: choose a directory path.")
    if path.is_dir():
        entries = [e for e in path.iterdir() if not e.name.startswith(".")]
        model = any(e.is_file() and _replaced(e.name) for e in entries)
        foreign = [e.name for e in entries if not (e.is_dir() and e.name.startswith("step="))]
        if foreign and not model:
            raise FileExistsError(
                f"export target {path} holds files that are not a Hugging Face model (e.g. {sorted(foreign)[:3]}): "
                "export into a new or empty directory, or into a model directory (its weights are replaced)."
            )
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"export target {path} cannot be created: {parent} is not a writable directory.")
    return path


def _carry_over(old: Path, new: Path) -> None:
    """Link (else copy) into ``new`` what of the model directory ``old`` an export does not replace and did not
    write: tokenizer files, README, periodic exports."""
    for entry in old.iterdir():
        if entry.name.startswith(".") and entry.name != ".gitattributes" or (new / entry.name).exists():
            continue
        if entry.is_file() and _replaced(entry.name):
            continue
        target = new / entry.name
        if entry.is_symlink():
            os.symlink(os.readlink(entry), target)
        elif entry.is_dir():
            shutil.copytree(entry, target, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(entry), str(target))


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _remove_unfinished(tmp: Path) -> None:
    """Remove an unfinished export's hidden directory; what could not be removed is named in a warning, with why."""
    errors: list[str] = []

    def note(func: Any, where: str, exc: Any) -> None:  # onexc (3.12+) gets the exception, onerror its exc_info
        errors.append(f"{where}: {exc[1] if isinstance(exc, tuple) else exc}")

    for _ in range(2):  # a second pass for anything that appeared while the first ran
        errors.clear()
        if sys.version_info >= (3, 12):
            shutil.rmtree(tmp, onexc=note)
        else:
            shutil.rmtree(tmp, onerror=note)
        if not tmp.exists():
            return
    log.warning("SlideDP: could not remove %s, left by an unfinished export: %s", tmp, "; ".join(errors[:3]))


@contextmanager
def export_directory(directory: str | os.PathLike, nbytes: int = 0) -> Generator[Path, None, None]:
    """A hidden sibling of ``directory`` to write an export into; on success it replaces ``directory`` (what of an
    earlier model there an export does not replace is carried over), on failure it is removed (a full disk named,
    with about ``nbytes`` needed when known)."""
    path = check_export_target(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    checkpoint_files.remove_stale_saves(path)
    tmp = checkpoint_files.hidden_sibling(path, "tmp")
    tmp.mkdir()
    try:
        yield tmp
        if path.is_dir():
            _carry_over(path, tmp)
        checkpoint_files.swap_in(tmp, path)
    except BaseException as err:
        _remove_unfinished(tmp)
        if not isinstance(err, (KeyboardInterrupt, SystemExit)) and checkpoint_files.no_space(err, path.parent):
            raise checkpoint_files.space_error(err, path, "Hugging Face export", nbytes) from None
        raise


# -- writing ------------------------------------------------------------------------------------------------


def write_hf(
    directory: str | os.PathLike,
    meta: dict[str, torch.Tensor],
    read: Fetch,
    config,
    generation,
    dtype: torch.dtype,
    max_shard_size: str | int,
) -> None:
    """Write the tensors named by ``meta`` (shape and dtype only) one shard at a time, each tensor fetched by
    ``read([name])`` and converted before the next is fetched, then the config (and generation config, if any), into ``directory`` (an existing
    directory: the caller swaps it into place; see :func:`export_directory`)."""
    directory = Path(directory)

    def target(t: torch.Tensor) -> torch.dtype:
        return dtype if t.is_floating_point() else t.dtype

    meta = {n: torch.empty(t.shape, dtype=target(t), device="meta") for n, t in meta.items()}
    split = split_torch_state_dict_into_shards(
        meta, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    for filename, names in split.filename_to_tensors.items():
        # a tensor at a time: one read may be a copy (a master on disk), gone once converted into the shard
        shard = {n: read([n])[n].to(meta[n].dtype, copy=True).contiguous() for n in names}
        save_file(shard, str(directory / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {
            "metadata": {"total_size": sum(m.numel() * m.element_size() for m in meta.values())},
            "weight_map": split.tensor_to_filename,
        }
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(directory)
    settings = json.loads((directory / "config.json").read_text())
    settings["torch_dtype" if "torch_dtype" in settings else "dtype"] = str(dtype).removeprefix("torch.")
    (directory / "config.json").write_text(json.dumps(settings, indent=2))
    if generation is not None:
        generation.save_pretrained(directory)


def save_hf(
    engine: EngineView,
    directory: str | os.PathLike,
    dtype: str | torch.dtype = torch.bfloat16,
    max_shard_size: str | int = "5GB",
    adapter_only: bool = False,
) -> None:
    """Write ``directory`` so that ``AutoModelForCausalLM.from_pretrained(directory)`` loads the trained weights
    (a peft model: merged), or with ``adapter_only`` so that ``PeftModel.from_pretrained(base, directory)`` loads
    the trained adapters. Call it on every rank (rank 0 writes)."""
    dtype = _dtype(dtype)
    model = engine.model
    if not hasattr(model, "config") or not hasattr(model.config, "save_pretrained"):
        raise TypeError(f"{type(model).__name__} has no Hugging Face config to export with.")
    if adapter_only and not is_peft_model(model):
        raise TypeError(f"adapter_only export needs a peft model; {type(model).__name__} holds no adapters.")
    engine.state.require_whole_parameters("save_hf")
    engine.synchronize()
    failed: BaseException | None = None
    if engine.topology.global_rank == 0:
        try:
            target = check_export_target(directory)
            tensors, fetch = engine.state.model_reader(model)  # (a master on disk: read a tensor at a time)
            with (
                engine.state.disk_paging(),
                export_directory(target, 0 if adapter_only else export_bytes(tensors, dtype)) as tmp,
            ):
                if adapter_only:
                    write_adapters(tmp, peft_wrapper(engine.root, model), fetch, dtype)
                else:
                    meta, read = merged_view(model, tensors, fetch) if is_peft_model(model) else (tensors, fetch)
                    write_hf(
                        tmp, meta, read, model.config, getattr(model, "generation_config", None), dtype, max_shard_size
                    )
            engine.state.release_disk_views()
            log.info(
                "SlideDP: Hugging Face export (%s%s) written to %s",
                dtype,
                ", adapters" if adapter_only else ", merged" if is_peft_model(model) else "",
                target,
            )
        except BaseException as err:
            failed = err
    if engine.topology.job_group is not None:
        box = [None if failed is None else f"{type(failed).__name__}: {failed}"]
        dist.broadcast_object_list(box, src=0, group=engine.topology.job_group)
        if failed is None and box[0] is not None:
            raise RuntimeError(f"SlideDP: rank 0 could not export to {directory}: {box[0]}")
    if failed is not None:
        raise failed


class ExportStopped(BaseException):
    """The export was asked to stop (see :func:`export_checkpoint`); nothing of it is left."""


def export_checkpoint(
    checkpoint: str | os.PathLike,
    directory: str | os.PathLike,
    dtype: str | torch.dtype = torch.bfloat16,
    max_shard_size: str | int = "5GB",
    config: str | os.PathLike | None = None,
    adapter_only: bool = False,
    stop: threading.Event | None = None,
) -> None:
    """Write a ``save_pretrained`` directory from a distributed SlideDP checkpoint, in one process, without the
    training job: one shard's tensors are read from the checkpoint at a time (whatever host layout, number of
    hosts or ranks saved it). ``config``: a Hugging Face model directory or ``config.json``, needed only when the
    checkpoint does not carry the model's config. A checkpoint of a peft (LoRA) model exports merged, or with
    ``adapter_only`` its adapters alone in peft's format. ``stop``, once set, ends the export before its next shard
    or before it replaces ``directory`` with :class:`ExportStopped` (``directory`` unchanged, nothing left): a
    signal handler's exception can be lost (raised inside a finalizer, Python ignores it), its event cannot."""
    dtype = _dtype(dtype)
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"{checkpoint} is not a SlideDP distributed checkpoint directory (no {sharded.META}).")
    target = check_export_target(directory)  # before any reading
    info = sharded.read_meta(checkpoint)["slidedp"]
    expected = info.get(sharded.CHECKSUMS) or {}
    sharded.check_files(checkpoint, expected, sorted(expected))
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig  # after the checks: it takes seconds

    if config is not None:
        hf_config = AutoConfig.from_pretrained(Path(config).parent if Path(config).is_file() else config)
    elif info.get("hf_config"):
        settings = dict(info["hf_config"])
        hf_config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    else:
        raise ValueError(f"{checkpoint} does not carry a Hugging Face config: pass config=<model dir>.")
    generation = GenerationConfig.from_dict(info["generation_config"]) if info.get("generation_config") else None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    peft_model = _peft_skeleton(checkpoint, model, info) if any(".lora_" in k for k in info["params"]) else None
    if adapter_only and peft_model is None:
        raise TypeError(f"adapter_only export needs a peft checkpoint; {checkpoint} holds no adapters.")
    first = next(iter(model.state_dict()))
    found = [c for c in sorted(set(info["params"]) | set(info["buffers"])) if c == first or c.endswith("." + first)]
    if len(found) != 1:
        raise KeyError(
            f"{checkpoint} does not hold {first!r} once (found {found}): was it saved from a {type(model).__name__}?"
        )
    prefix = found[0][: len(found[0]) - len(first)]
    meta, seen = {}, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue  # the second name of a tied weight: written once, under the first
        seen.add(id(t))
        key = prefix + name
        if key in info["params"]:
            meta[name] = torch.empty(tuple(info["params"][key]), dtype=torch.float32, device="meta")
        elif key in info["buffers"]:
            meta[name] = info["buffers"][key]
        else:
            raise KeyError(f"{checkpoint} has no tensor for {key!r}: was it saved from a {type(model).__name__}?")
    missing = sorted(set(info["params"]) - {prefix + n for n in meta})
    if missing:
        raise KeyError(f"{checkpoint} holds parameters the {type(model).__name__} does not have: {missing[:5]}")

    def stop_if_asked() -> None:
        if stop is not None and stop.is_set():
            raise ExportStopped(f"the export of {checkpoint} to {target} was stopped")

    def fetch(shard: list[str]) -> dict[str, torch.Tensor]:
        stop_if_asked()
        params = {n: torch.empty(meta[n].shape) for n in shard if prefix + n in info["params"]}
        wanted = [(f"model/{prefix}{n}", 0, t.numel(), t.view(-1)) for n, t in params.items()]
        with warnings.catch_warnings():  # one process reading on purpose
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            sharded.read_ranges(checkpoint, [w for w in wanted if w[2]], no_dist=True)
        return {**params, **{n: meta[n] for n in shard if n not in params}}

    with export_directory(target, 0 if adapter_only else export_bytes(meta, dtype)) as tmp:
        if adapter_only:
            assert peft_model is not None
            write_adapters(tmp, peft_model, fetch, dtype)
        else:
            out_meta, read = merged_view(model, meta, fetch) if peft_model is not None else (meta, fetch)
            write_hf(tmp, out_meta, read, hf_config, generation, dtype, max_shard_size)
        stop_if_asked()
    log.info("SlideDP: Hugging Face export (%s) of %s written to %s", dtype, checkpoint, target)


def _peft_skeleton(checkpoint: Path, model: nn.Module, info: dict[str, Any]) -> nn.Module:
    """The checkpoint's peft model around the meta ``model`` (its adapters injected as the run's were), from the
    peft configs its metadata carries."""
    configs = info.get("peft_config")
    if not configs:
        raise ValueError(
            f"{checkpoint} holds LoRA adapters but not their peft config (saved by an older release): export it "
            "with that release, or resume it with this one and save again."
        )
    from peft import PeftConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTuner

    adapters = list(configs)
    built = [PeftConfig.from_peft_type(**_config_args(configs[a])) for a in adapters]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, built[0], adapter_name=adapters[0])
        for name, cfg in zip(adapters[1:], built[1:]):
            peft_model.add_adapter(name, cfg)
        active = [a for a in info.get("peft_active") or adapters[:1] if a in configs]
        tuner = peft_model.base_model  # the tuner, not PeftModel, activates several adapters at once
        if active:
            if not isinstance(tuner, BaseTuner):
                raise ValueError(f"{checkpoint}: peft built a {type(tuner).__name__}, which cannot activate {active}")
            tuner.set_adapter(active if len(active) > 1 else active[0])
    return peft_model


def _config_args(settings: dict[str, Any]) -> dict[str, Any]:
    args = dict(settings)
    for key in ("target_modules", "exclude_modules"):
        if isinstance(args.get(key), list):
            args[key] = set(args[key])
    return args
