"""Where a new ledger's initial weights come from when they are not in the model: a :class:`WeightSource`.

A source reads one named parameter (any name the streamed model knows it by, tied names included), or a range of
its flattened elements, straight into a flat FP32 view of the ledger. :class:`SafetensorsWeights` is the one for
Hugging Face checkpoints: single-file or sharded safetensors, read tensor by tensor (a bounded block of rows at a
time) through memory-mapped ``safe_open`` handles, never a whole file into memory. Opening one reads the file
headers only and checks that every file is complete; the tensor data are touched first by the ledger fill.

A source travels with the model as the attribute :data:`WEIGHT_SOURCE_ATTR` (set by
``slidedp_lightning.from_pretrained``); the engine finds it there.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

WEIGHT_SOURCE_ATTR = "slidedp_weight_source"
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
    """The source registered on ``model`` (``None``: the model's own parameters are the initial weights)."""
    source = getattr(model, WEIGHT_SOURCE_ATTR, None)
    if source is not None and not isinstance(source, WeightSource):
        raise TypeError(
            f"{WEIGHT_SOURCE_ATTR} of {type(model).__name__} is a {type(source).__name__}, not a WeightSource"
        )
    return source


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

    def __getstate__(self) -> dict[str, Any]:  # a copied model carries the source, not its open files
        return {**self.__dict__, "_handles": {}}

    def names(self) -> set[str]:
        return set(self._tensors)

    def stored(self, name: str) -> StoredTensor:
        return self._tensors[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._tensors[name].shape

    def nbytes(self, name: str, count: int | None = None) -> int:
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

    def read_into(self, name: str, out: torch.Tensor, start: int = 0, bf16: torch.Tensor | None = None) -> None:
        t = self._tensors[name]
        count = out.numel()
        if start < 0 or start + count > t.numel:
            raise CheckpointError(f"elements [{start}, {start + count}) are outside {t.key!r} ({t.numel} elements)")
        if bf16 is not None and bf16.numel() != count:
            raise ValueError(f"the BF16 view holds {bf16.numel()} elements, the FP32 one {count}")
        if count == 0:
            return
        handle = self._handle(t)
        try:
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
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"cannot read tensor {t.key!r} from {t.file}: {err}") from err

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
