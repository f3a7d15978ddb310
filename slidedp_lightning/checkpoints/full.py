"""The full checkpoint format (``checkpoint_format="full"``): one ``torch.save`` file from global rank 0.

With Lightning's own :class:`~lightning.fabric.plugins.io.torch_io.TorchCheckpointIO` and a local path, the file is
written here instead: straight into a hidden sibling of the target in the same directory (no copy of the whole
checkpoint in memory first), synced, then renamed over the target, so that an interrupted or failed save leaves the
previous file whole and nothing partial behind; a full disk is refused in one line naming the path, the free and
needed bytes and the fix. Any other ``CheckpointIO`` (or ``storage_options``, or a remote path) gets the save as
Lightning would hand it over.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from slidedp_lightning.checkpoints.files import hidden_sibling, no_space, remove_stale_saves, space_error, write_target

log = logging.getLogger(__name__)


def tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in ``value`` (nested dicts, lists and tuples): about what saving it takes."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def save_full(io: Any, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
    """Write ``checkpoint`` to the file ``path`` (on the rank that holds it: global rank 0) through ``io``, the
    strategy's ``CheckpointIO``: atomically, a full disk named, when it is Lightning's plain one and ``path`` local."""
    fs, local = fsspec.core.url_to_fs(str(path))
    if type(io) is not TorchCheckpointIO or storage_options is not None or not isinstance(fs, LocalFileSystem):
        io.save_checkpoint(checkpoint, path, storage_options=storage_options)
        return
    target = write_target(Path(local))
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_saves(target)
    tmp = hidden_sibling(target, "tmp")
    try:
        with open(tmp, "wb") as f:  # a Python file: a failed write keeps its OSError (torch reports an assertion)
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if not isinstance(err, (KeyboardInterrupt, SystemExit)) and no_space(err, target.parent):
            raise space_error(err, target, "SlideDP full checkpoint", tensor_bytes(checkpoint)) from None
        raise
    log.debug("SlideDP full checkpoint written to %s", target)
