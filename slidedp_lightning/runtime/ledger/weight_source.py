"""Where a new ledger's initial weights come from when they are not in the model: a :class:`WeightSource`.

A source reads one named parameter (any name the streamed model knows it by, tied names included), or a range of
its flattened elements, straight into a flat FP32 view of the ledger. :class:`SafetensorsWeights` is the one for
Hugging Face checkpoints: single-file or sharded safetensors, read tensor by tensor (a bounded block of rows at a
time) through memory-mapped ``safe_open`` handles, never a whole file into memory. Opening one reads the file
headers only and checks that every file is complete; the tensor data are touched first by the ledger fill.
BF16 tensors (the common case) are read straight from the mapped file by one kernel that writes the FP32 master
and the BF16 copy in the same pass (no intermediate tensor); other formats go through torch's conversions.

A source travels with the model as the attribute :data:`WEIGHT_SOURCE_ATTR` (set by
``slidedp_lightning.from_pretrained``); the engine finds it there, fitted to the model as it is by then
(:meth:`SafetensorsWeights.for_model`): peft's wrappers read their base layer's stored tensor, and the adapters
peft added on the meta device take the values peft drew for them (recorded as peft created them, see
:data:`INITIAL_VALUES_ATTR`) or, created on the meta device itself (``meta_init``), peft's own initialization.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

WEIGHT_SOURCE_ATTR = "slidedp_weight_source"
# on a module: {parameter name: the value it was created with}, for parameters later moved to the meta device (peft
# adapters added to a meta skeleton lose the values peft drew for them); recorded by pretrained.loading_into_ledger
INITIAL_VALUES_ATTR = "_slidedp_initial_values"
# peft's wrappers: the base layer's tensor under these names (a modules_to_save copy starts as the original)
_PEFT_WRAPPING = re.compile(r"\.(base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# elements of one block read from a file and converted at once (its BF16 copy converted from it right after)
BLOCK_ELEMS = 1 << 24
# safetensors dtype -> (bytes per element, torch dtype) of the floating formats a parameter may be stored in
FLOAT_DTYPES: dict[str, tuple[int, torch.dtype]] = {
    "BF16": (2, torch.bfloat16),
    "F16": (2, torch.float16),
    "F32": (4, torch.float32),
    "F64": (8, torch.float64),
}
_NUMPY = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F64": np.float64}


class CheckpointError(ValueError):
    """A checkpoint cannot be read into the ledger: the message names the tensors or the file."""


@runtime_checkable
class WeightSource(Protocol):
    """The initial value of the streamed model's parameters, readable one parameter (or element range) at a time."""

    def names(self) -> set[str]:
        """Every parameter name (as the streamed model's ``named_parameters(remove_duplicate=False)``) it provides."""
        ...

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of parameter ``name``."""
        ...

    def nbytes(self, name: str, count: int | None = None) -> int:
        """Bytes read from storage for ``count`` elements of ``name`` (default: all of them)."""
        ...

    def read_into(self, name: str, out: torch.Tensor, start: int = 0, bf16: torch.Tensor | None = None) -> None:
        """Write elements ``[start, start + out.numel())`` of the flattened parameter ``name`` into ``out``, a flat
        FP32 tensor (converted exactly as ``tensor.to(torch.float32)`` does); with ``bf16`` (as long as ``out``),
        also their BF16 copy, converted from the FP32 values (the bits ``bf16.copy_(out)`` would write)."""
        ...

    def describe(self) -> str:
        """A short description for logs (where the weights come from)."""
        ...

    def close(self) -> None:
        """Release open files; reading again reopens them."""
        ...


def weight_source_of(model: nn.Module) -> WeightSource | None:
    """The source registered on ``model`` (``None``: the model's own parameters are the initial weights), fitted
    to the model's parameters as they are now (:meth:`SafetensorsWeights.for_model`)."""
    source = getattr(model, WEIGHT_SOURCE_ATTR, None)
    if source is not None and not isinstance(source, WeightSource):
        raise TypeError(
            f"{WEIGHT_SOURCE_ATTR} of {type(model).__name__} is a {type(source).__name__}, not a WeightSource"
        )
    if isinstance(source, SafetensorsWeights):
        return source.for_model(model)
    return source


def _peft_initial(
    model: nn.Module, owner_name: str, cache: dict[str, dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The initial values peft gives the adapter parameters of the module ``owner_name`` (``<layer>.<container>.
    <adapter>``, or ``<layer>.<container>`` for a parameter dict) when they were created on the meta device:
    a copy of the peft layer, materialized on the CPU, initialized by its own ``reset_parameters`` and
    ``reset_lora_parameters``. Empty where that does not apply (another kind of module, a LoRA variant)."""
    parts = owner_name.split(".")
    for cut in (len(parts) - 2, len(parts) - 1):
        layer_name, rest = ".".join(parts[:cut]), parts[cut:]
        try:
            layer: Any = model.get_submodule(layer_name)
        except AttributeError:
            continue
        configs = getattr(model, "peft_config", None) or {}
        if not (type(layer).__module__.startswith("peft.") and hasattr(layer, "reset_lora_parameters")):
            continue
        if rest[0] not in getattr(layer, "adapter_layer_names", ()):
            continue
        adapter = rest[1] if len(rest) > 1 else None
        key = f"{layer_name}@{adapter}"
        if key not in cache:
            cache[key] = {}
            if adapter is None or adapter not in configs or getattr(layer, "lora_variant", {}).get(adapter) is not None:
                return cache[key]
            twin: Any = copy.deepcopy(layer)  # the model's own parameters stay as the engine bound them
            for container in twin.adapter_layer_names:
                held = getattr(twin, container, None)
                if isinstance(held, nn.ModuleDict) and adapter in held:
                    held[adapter].to_empty(device="cpu")
                    for m in held[adapter].modules():
                        reset = getattr(m, "reset_parameters", None)
                        if callable(reset):
                            reset()
                elif isinstance(held, nn.ParameterDict) and adapter in held:
                    held[adapter] = nn.Parameter(torch.zeros(held[adapter].shape), held[adapter].requires_grad)
            with torch.no_grad():
                twin.reset_lora_parameters(adapter, configs[adapter].init_lora_weights)
            for container in twin.adapter_layer_names:
                held = getattr(twin, container, None)
                if isinstance(held, nn.ModuleDict) and adapter in held:
                    for n, t in held[adapter].named_parameters():
                        cache[key][f"{layer_name}.{container}.{adapter}.{n}"] = t.detach()
                elif isinstance(held, nn.ParameterDict) and adapter in held:
                    cache[key][f"{layer_name}.{container}.{adapter}"] = held[adapter].detach()
        return cache[key]
    return {}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file, from its header."""

    file: str
    key: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name ("BF16", "F32", ...)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return FLOAT_DTYPES[self.dtype][0] if self.dtype in FLOAT_DTYPES else 0


def _safe_open(path: str) -> Any:
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as err:  # SafetensorError (not exported) or OSError: name the file either way
        raise CheckpointError(
            f"cannot read safetensors file {path}: {err} (a truncated, partly downloaded or corrupt file? "
            "download it again)"
        ) from err


def data_offsets(path: str) -> dict[str, int]:
    """Byte offset in ``path`` of every tensor's data whose extent in the header matches its shape and dtype (the
    safetensors layout: an 8-byte little-endian header length, the JSON header, then the data)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    start, out = 8 + size, {}
    for key, entry in header.items():
        if key == "__metadata__" or not isinstance(entry, dict) or entry.get("dtype") not in FLOAT_DTYPES:
            continue
        begin, end = entry["data_offsets"]
        if end - begin == math.prod(entry["shape"]) * FLOAT_DTYPES[entry["dtype"]][0]:
            out[key] = start + begin
    return out


def checkpoint_files(directory: str) -> list[str]:
    """The safetensors files of a ``save_pretrained`` directory (the index's shards, or the single file)."""
    index = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"cannot read the shard index {index}: {err}") from err
        return [os.path.join(directory, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(directory, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    present = sorted(os.listdir(directory))
    other = [n for n in present if n.endswith((".bin", ".pt", ".pth", ".gguf")) or n.endswith(".safetensors")]
    raise CheckpointError(
        f"{directory} holds no {SINGLE_FILE} and no {INDEX_FILE}"
        + (f" (found {other[:5]})" if other else "")
        + ": SlideDP reads the weights from safetensors files as save_pretrained writes them; convert the checkpoint "
        "(AutoModelForCausalLM.from_pretrained(...).save_pretrained(DIR)) or load it with transformers' from_pretrained."
    )


def scan_safetensors(directory: str) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint in ``directory`` by its key, from the file headers only (no tensor data);
    every file must be readable and complete, and every key of the index must be in the file it names."""
    files = checkpoint_files(directory)
    index = os.path.join(directory, INDEX_FILE)
    expected: dict[str, str] = {}
    if os.path.isfile(index):
        with open(index) as f:
            expected = {k: os.path.join(directory, v) for k, v in json.load(f)["weight_map"].items()}
    stored: dict[str, StoredTensor] = {}
    for path in files:
        if not os.path.isfile(path):
            raise CheckpointError(
                f"the shard index {index} names {path}, which does not exist (an incomplete download?)"
            )
        handle = _safe_open(path)
        for key in handle.keys():
            if key in stored:
                raise CheckpointError(f"tensor {key!r} is stored twice: in {stored[key].file} and in {path}")
            piece = handle.get_slice(key)
            stored[key] = StoredTensor(path, key, tuple(int(d) for d in piece.get_shape()), str(piece.get_dtype()))
        del handle
    wrong = [(k, f) for k, f in expected.items() if k not in stored or stored[k].file != f]
    if wrong:
        k, where = wrong[0]
        raise CheckpointError(
            f"the shard index {index} places {len(wrong)} tensor(s) in files that do not hold them, e.g. {k!r} in "
            f"{where}" + (f" (it is in {stored[k].file})" if k in stored else "")
        )
    return stored


class SafetensorsWeights:
    """A :class:`WeightSource` over safetensors files: ``tensors`` maps every parameter name to its stored tensor
    (tied names to the same one)."""

    def __init__(self, tensors: Mapping[str, StoredTensor], description: str) -> None:
        bad = [f"{n} ({t.key}: {t.dtype})" for n, t in tensors.items() if t.dtype not in FLOAT_DTYPES]
        if bad:
            raise CheckpointError(
                f"parameters stored in a format SlideDP does not convert: {bad[:5]}; it reads floating-point "
                f"weights ({', '.join(FLOAT_DTYPES)}) into the FP32 master (quantized checkpoints are not supported)."
            )
        self._tensors = dict(tensors)
        self._description = description
        self._handles: dict[str, Any] = {}
        self._maps: dict[str, tuple[np.ndarray, dict[str, int]]] = {}
        self._initial: dict[str, torch.Tensor] = {}  # parameters not in the files: their values (peft adapters)

    def for_model(self, model: nn.Module) -> SafetensorsWeights:
        """This source for ``model`` as it is now (the skeleton it was made for, perhaps wrapped by peft since): a
        parameter inside a peft wrapper reads its base layer's stored tensor, an adapter peft added takes the
        values it was created with. A parameter left without a value is refused when the source is read, with the
        checkpoint's other mismatches (:meth:`~slidedp_lightning.runtime.ledger.initial_weights.InitialWeights`)."""
        fitted = copy.copy(self)
        fitted._tensors, fitted._initial = dict(self._tensors), dict(self._initial)
        fitted._handles, fitted._maps = {}, {}
        params = dict(model.named_parameters(remove_duplicate=False))
        cache: dict[str, dict[str, torch.Tensor]] = {}
        for name, param in params.items():
            if name in fitted._tensors or name in fitted._initial:
                continue
            base = _PEFT_WRAPPING.sub("", name)
            if base in fitted._tensors:
                fitted._tensors[name] = fitted._tensors[base]
                continue
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            value = owner.__dict__.get(INITIAL_VALUES_ATTR, {}).get(attr)
            if value is None and not param.is_meta:
                value = param.detach()
            if value is None:
                value = _peft_initial(model, owner_name, cache).get(name)
            if value is not None and tuple(value.shape) == tuple(param.shape):
                fitted._initial[name] = value.detach()
        return fitted

    def __getstate__(self) -> dict[str, Any]:  # a copied model carries the source, not its open files
        return {**self.__dict__, "_handles": {}, "_maps": {}}

    def names(self) -> set[str]:
        return set(self._tensors) | set(self._initial)

    def stored(self, name: str) -> StoredTensor:
        return self._tensors[name]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._initial:
            return tuple(self._initial[name].shape)
        return self._tensors[name].shape

    def nbytes(self, name: str, count: int | None = None) -> int:
        if name in self._initial:
            value = self._initial[name]
            return (value.numel() if count is None else count) * value.element_size()
        t = self._tensors[name]
        return (t.numel if count is None else count) * t.itemsize

    def total_bytes(self, names: Iterable[str] | None = None) -> int:
        """Bytes of the distinct stored tensors behind ``names`` (default: all)."""
        chosen = {self._tensors[n] for n in (self._tensors if names is None else names)}
        return sum(t.numel * t.itemsize for t in chosen)

    def describe(self) -> str:
        return self._description

    def _handle(self, t: StoredTensor) -> Any:
        handle = self._handles.get(t.file)
        if handle is None:
            handle = self._handles[t.file] = _safe_open(t.file)
        return handle

    def _mapped(self, t: StoredTensor) -> np.ndarray | None:
        """The data of ``t`` as a read-only array over the mapped file (its stored dtype, BF16 as uint16 bits), or
        None where it cannot be read that way (then :meth:`read_into` goes through safe_open)."""
        if sys.byteorder != "little" or t.dtype not in _NUMPY:
            return None
        self._handle(t)  # checks the file again (complete, readable) before it is mapped
        mapped = self._maps.get(t.file)
        if mapped is None:
            mapped = self._maps[t.file] = (np.memmap(t.file, dtype=np.uint8, mode="r"), data_offsets(t.file))
        data, offsets = mapped
        offset, nbytes = offsets.get(t.key), t.numel * t.itemsize
        if offset is None or offset % t.itemsize or offset + nbytes > data.shape[0]:
            return None
        return data[offset : offset + nbytes].view(_NUMPY[t.dtype])

    def read_into(self, name: str, out: torch.Tensor, start: int = 0, bf16: torch.Tensor | None = None) -> None:
        if name in self._initial:  # a value held in memory (a peft adapter's initial value)
            out.copy_(self._initial[name].reshape(-1)[start : start + out.numel()])
            if bf16 is not None:
                bf16.copy_(out)
            return
        t = self._tensors[name]
        count = out.numel()
        if start < 0 or start + count > t.numel:
            raise CheckpointError(f"elements [{start}, {start + count}) are outside {t.key!r} ({t.numel} elements)")
        if bf16 is not None and bf16.numel() != count:
            raise ValueError(f"the BF16 view holds {bf16.numel()} elements, the FP32 one {count}")
        if count == 0:
            return
        try:
            flat = _flat_cpu(out, torch.float32) and (bf16 is None or _flat_cpu(bf16, torch.bfloat16))
            data = self._mapped(t) if flat else None
            if data is not None:
                _convert(data[start : start + count], t.dtype, out, bf16)
            else:
                self._read_sliced(t, out, start, bf16)
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"cannot read tensor {t.key!r} from {t.file}: {err}") from err

    def _read_sliced(self, t: StoredTensor, out: torch.Tensor, start: int, bf16: torch.Tensor | None) -> None:
        """:meth:`read_into` through safe_open: rows holding the range, a bounded block at a time, each copied and
        converted by torch."""
        count = out.numel()
        handle = self._handle(t)
        blocks: Iterable[tuple[int, torch.Tensor]]
        if len(t.shape) == 0:  # a scalar cannot be sliced
            blocks = [(0, handle.get_tensor(t.key).reshape(-1))]
        else:
            # rows holding the range, a bounded block at a time (the handle maps the file: no whole-file read)
            piece = handle.get_slice(t.key)
            row = math.prod(t.shape[1:])
            first, last = start // row, -(-(start + count) // row)
            step = max(1, BLOCK_ELEMS // max(row, 1))
            blocks = ((r * row, piece[r : min(r + step, last)].reshape(-1)) for r in range(first, last, step))
        pos = 0
        for offset, block in blocks:
            lo, hi = max(start - offset, 0), min(start + count - offset, block.numel())
            dest = out[pos : pos + hi - lo]
            dest.copy_(block[lo:hi])
            if bf16 is not None:  # from the FP32 values just written
                bf16[pos : pos + hi - lo].copy_(dest)
            pos += hi - lo

    def equal(self, a: str, b: str) -> bool:
        """Whether two stored tensors hold the same values once converted to FP32 (read block by block)."""
        ta, tb = self._tensors[a], self._tensors[b]
        if ta.shape != tb.shape:
            return False
        block = 1 << 22
        x, y = torch.empty(min(block, ta.numel)), torch.empty(min(block, ta.numel))
        for s in range(0, ta.numel, block):
            n = min(block, ta.numel - s)
            self.read_into(a, x[:n], s)
            self.read_into(b, y[:n], s)
            if not torch.equal(x[:n], y[:n]):
                return False
        return True

    def close(self) -> None:
        self._handles.clear()
        self._maps.clear()


def _flat_cpu(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() and not t.requires_grad


def _convert(data: np.ndarray, dtype: str, out: torch.Tensor, bf16: torch.Tensor | None) -> None:
    """``data`` (stored values, BF16 as uint16 bits) into the FP32 ``out`` and, with ``bf16``, its BF16 copy: BF16
    by one fused pass (:func:`cpu_ops.widen_bf16`), other formats by torch a cache-sized block at a time."""
    from cpu_ops import bf16_to_fp32, widen_bf16

    if dtype == "BF16":
        master = out.numpy()
        for a in range(0, data.shape[0], BLOCK_ELEMS):
            b = min(a + BLOCK_ELEMS, data.shape[0])
            if bf16 is None:
                bf16_to_fp32(data[a:b], master[a:b])
            elif widen_bf16(data[a:b], master[a:b], bf16[a:b].view(torch.int16).numpy().view(np.uint16)):
                bf16[a:b].copy_(out[a:b])  # NaNs among them: torch's bits for those
        return
    with warnings.catch_warnings():  # the mapping is read-only, and only read
        warnings.simplefilter("ignore", UserWarning)
        values = torch.from_numpy(data)
    block = 1 << 18  # the BF16 copy reads the FP32 values back while they are in cache
    for a in range(0, values.numel(), block):
        out[a : a + block].copy_(values[a : a + block])
        if bf16 is not None:
            bf16[a : a + block].copy_(out[a : a + block])
