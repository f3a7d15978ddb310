"""Every use of a private PyTorch interface in the package, each with what it depends on.

Torch offers no public form of these; each is kept to the smallest access, and tests/runtime/test_compat.py
checks every one against the installed release, so that an upgrade that changes one fails there, by name,
rather than as a wrong result in training:

- :func:`disable_dispatch_modes`: ``torch.utils._python_dispatch._disable_current_modes``;
- :func:`tensor_version`: ``Tensor._version``, the in-place version counter autograd checks;
- :func:`queue_backward_callback`: ``torch.autograd.Variable._execution_engine.queue_callback``;
- :func:`selective_checkpoint_contexts`: the cache that the two contexts of the public
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` share (their ``storage`` attribute, its
  access forms and the version-checked wrappers of its entries);
- :class:`CheckedFileSystemReader`: the name and the pickled contents of the ``.metadata`` file of
  ``torch.distributed.checkpoint``'s file system format, which its reader unpickles without restriction.

Public names that differ between releases (the collectives' tensor forms) are at the end.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import pickle
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import create_selective_checkpoint_contexts


def disable_dispatch_modes() -> AbstractContextManager:
    """Run the block outside every active ``TorchDispatchMode`` (restored on exit).

    Depends on ``torch.utils._python_dispatch._disable_current_modes``. Selective checkpointing counts the
    operators of a region through such a mode and replays its saved outputs by count in backward; tensor work
    done on the region's behalf (retaining, offloading, reloading) must not be counted, or the recompute
    reads the wrong outputs. If torch drops the function, importing this module fails."""
    return _disable_current_modes()


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s in-place version counter (``Tensor._version``): a changed value means the data was modified
    in place. Used to tell two saves of one tensor from saves of its successive contents."""
    return t._version


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Call ``fn`` once the backward pass now running has finished (every gradient computed).

    Depends on ``torch.autograd.Variable._execution_engine.queue_callback`` (what FSDP uses); it may only be
    called from inside a backward pass. If torch removes it, this raises AttributeError."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


# -- selective activation checkpointing -------------------------------------------------------------------


class _Stashed:
    """A cached operator output handed to ``stash``: what ``stash`` returned for it."""

    __slots__ = ("handle",)

    def __init__(self, handle: Any) -> None:
        self.handle = handle


def _wrappers(entry: Any) -> Iterator[Any]:
    """The version-checked wrappers in a cache entry: torch maps each leaf of an operator's output (a tensor,
    or a tuple/list of them and of non-tensors) to an object with ``val`` and ``version``; other entries are
    torch's markers (recompute, consumed), which hold none."""
    if isinstance(entry, (tuple, list)):
        for item in entry:
            yield from _wrappers(item)
    elif isinstance(entry, dict):
        for item in entry.values():
            yield from _wrappers(item)
    elif hasattr(entry, "val") and hasattr(entry, "version"):
        yield entry


class SelectiveCacheStore(defaultdict):
    """A stand-in for the cache of selective checkpointing that hands every cached operator output to
    ``stash`` when torch stores it and gets it back from ``unstash`` when torch reads it in backward.

    Depends on torch's cache being ``storage[op]`` per operator, holding entries in either of torch's forms:
    ``{call index: entry}`` (torch >= 2.13: ``storage[op][i] = entry``, ``storage[op].get(i)``) or a list in
    call order (earlier releases: ``storage[op].append(entry)``, ``storage[op].pop(0)``), each entry a pytree
    of wrappers with the output in ``val`` and its version counter in ``version`` (checked when read: it is
    set to the returned tensor's, whose counter is its own). ``stash(t)`` may return ``t`` itself (kept as
    is) or any handle."""

    def __init__(self, stash: Callable[[torch.Tensor], Any], unstash: Callable[[Any], torch.Tensor]) -> None:
        super().__init__(lambda: _CacheEntries(stash, unstash))


class _CacheEntries(dict):
    def __init__(self, stash: Callable[[torch.Tensor], Any], unstash: Callable[[Any], torch.Tensor]) -> None:
        super().__init__()
        self._stash, self._unstash = stash, unstash
        self._appended = 0

    def __setitem__(self, index: Any, entry: Any) -> None:
        for w in _wrappers(entry):
            if isinstance(w.val, torch.Tensor):
                handle = self._stash(w.val)
                w.val = handle if isinstance(handle, torch.Tensor) else _Stashed(handle)
        super().__setitem__(index, entry)

    def append(self, entry: Any) -> None:
        self[self._appended] = entry
        self._appended += 1

    def pop(self, index: Any = 0, *default: Any) -> Any:
        """The list form's ``pop(0)``: the oldest entry not yet read, brought back."""
        if index != 0:
            raise IndexError("selective checkpointing reads its saved outputs in call order")
        return self._restore(super().pop(min(self)))

    def get(self, index: Any, default: Any = None) -> Any:
        entry = super().get(index, default)
        return None if entry is None else self._restore(entry)

    def _restore(self, entry: Any) -> Any:
        for w in _wrappers(entry):
            if isinstance(w.val, _Stashed):
                w.val = self._unstash(w.val.handle)
                w.version = tensor_version(w.val)
        return entry


def selective_checkpoint_contexts(
    policy_fn: Callable[..., Any], stash: Callable[[torch.Tensor], Any], unstash: Callable[[Any], torch.Tensor]
) -> tuple[AbstractContextManager, AbstractContextManager]:
    """``torch.utils.checkpoint.create_selective_checkpoint_contexts(policy_fn)`` (the public API: a
    ``context_fn`` for ``checkpoint``), with its cache of saved operator outputs replaced by a
    :class:`SelectiveCacheStore` over ``stash``/``unstash``.

    Depends on both returned contexts reading and writing the cache through their ``storage`` attribute
    (as torch 2.13 does). Without it the outputs would stay on the device in torch's own cache, out of
    ``stash``'s reach; so a release whose contexts lack the attribute is refused here, with this error."""
    caching, cached = create_selective_checkpoint_contexts(policy_fn)
    for ctx in (caching, cached):
        if not isinstance(getattr(ctx, "storage", None), dict):
            raise RuntimeError(
                f"torch {torch.__version__}: the selective-checkpoint context {type(ctx).__name__} keeps no "
                "'storage' cache, so SlideDP cannot account and offload the operator outputs it saves; use the "
                "'full' or 'segments' activation modes with this torch release."
            )
    store = SelectiveCacheStore(stash, unstash)
    caching.storage = cached.storage = store
    return caching, cached


# -- distributed checkpoint metadata ----------------------------------------------------------------------

DCP_METADATA = ".metadata"  # the file DCP's FileSystemWriter pickles the checkpoint's Metadata into
# globals DCP's metadata pickle names besides its own dataclasses and enums (torch 2.13): tensor sizes and
# dtypes, the layout by name, the checkpoint path in StorageMeta
_DCP_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    *(("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")),
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file names something that loading it could run: refused, nothing of it was executed."""


def _dcp_global(module: str, name: str) -> Any:
    """The object a DCP metadata pickle may name: None when it may name nothing of that name."""
    if "." in name or not (module == "torch" or module == "pathlib" or module.startswith("torch.")):
        return None
    obj = getattr(sys.modules.get(module), name, None)  # only modules already imported: nothing is imported
    if (module, name) in _DCP_GLOBALS or (module == "torch" and isinstance(obj, torch.dtype)):
        return obj
    in_dcp = module == "torch.distributed.checkpoint" or module.startswith("torch.distributed.checkpoint.")
    if in_dcp and isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
        return obj  # plain records and enums: building one runs no code of the file's choosing
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, source: Path) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        obj = _dcp_global(module, name)
        if obj is None:
            raise UnsafeCheckpointError(
                f"{self.source} names {module}.{name}, which no torch.distributed.checkpoint metadata holds: "
                "refusing to load it (unpickling it could run code). Is the checkpoint from a trusted source?"
            )
        return obj


def check_dcp_metadata(path: str | os.PathLike) -> None:
    """Raise :class:`UnsafeCheckpointError` unless the pickle at ``path`` (a DCP ``.metadata`` file) holds
    only DCP's metadata records, sizes, dtypes and paths. Nothing it names is called unless allowed.

    Depends on what DCP pickles into that file (torch 2.13: the dataclasses of
    ``torch.distributed.checkpoint.metadata`` and ``filesystem._StorageInfo``, ``torch.Size``, dtypes,
    ``torch.serialization._get_layout``, a ``pathlib`` path); a release that pickles more is refused here,
    with the name, until the list above admits it."""
    path = Path(path)
    with open(path, "rb") as f:
        _MetadataUnpickler(f, path).load()


class CheckedFileSystemReader(dcp.FileSystemReader):
    """``torch.distributed.checkpoint.FileSystemReader`` that checks the checkpoint's ``.metadata`` pickle
    (:func:`check_dcp_metadata`) before DCP unpickles it, so that a planted payload is refused, not run.

    Depends on the reader reading ``<checkpoint>/.metadata`` (``__<rank>.metadata`` when asked for a rank's)
    in ``read_metadata``; the tensor data it reads with ``torch.load(weights_only=True)``. The metadata is
    checked, read and unpickled once per reader: a load's checks and DCP's own read share it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._metadata: dict[Any, Any] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        if rank not in self._metadata:
            name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
            check_dcp_metadata(Path(self.checkpoint_id) / name)
            self._metadata[rank] = super().read_metadata(*args, **kwargs)
        metadata = self._metadata[rank]
        metadata.storage_meta.load_id = self.load_id  # as the base reader sets it (a reset draws another)
        return metadata


# collectives under the names of this torch release (2.13 renamed the tensor forms; older ones have the old)
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
