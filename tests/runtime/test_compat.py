"""runtime.compat: each private PyTorch interface the package uses exists in the installed torch and behaves as
the package relies on. A failure here names the interface a torch upgrade changed."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from slidedp_lightning.runtime import compat


class _Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_disable_dispatch_modes_hides_tensor_work_from_the_active_mode():
    a = torch.randn(3, 3)
    with _Counting() as mode:
        torch.mm(a, a)
        seen = len(mode.ops)
        with compat.disable_dispatch_modes():
            torch.mm(a, a).clone()
        assert len(mode.ops) == seen, "work inside disable_dispatch_modes reached the dispatch mode"
        torch.mm(a, a)
    assert seen >= 1 and len(mode.ops) == 2 * seen


def test_tensor_version_counts_in_place_writes_only():
    t = torch.zeros(4)
    v = compat.tensor_version(t)
    assert isinstance(v, int)
    _ = t + 1
    assert compat.tensor_version(t) == v
    t.add_(1)
    assert compat.tensor_version(t) == v + 1


def test_queue_backward_callback_runs_once_after_every_gradient():
    x = torch.randn(5, requires_grad=True)
    y = torch.randn(5, requires_grad=True)
    calls: list[tuple[bool, bool]] = []

    def hook(grad):
        compat.queue_backward_callback(lambda: calls.append((x.grad is not None, y.grad is not None)))
        return grad

    x.register_hook(hook)
    ((x * 2).sum() + (y * 3).sum()).backward()
    assert calls == [(True, True)], "the callback runs once, when the whole backward pass is done"


def test_selective_contexts_of_this_torch_share_one_storage_cache():
    """The internal selective_checkpoint_contexts replaces: both contexts read and write one ``storage``."""
    caching, cached = create_selective_checkpoint_contexts([torch.ops.aten.mm.default])
    assert isinstance(caching.storage, dict) and caching.storage is cached.storage


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


def _region(x, w):
    return (torch.mm(torch.sigmoid(torch.mm(x, w)), w) ** 2).sum()  # backward reads both mm outputs


def test_selective_checkpoint_contexts_pass_every_saved_output_through_stash_and_unstash():
    x, w = torch.randn(4, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True)
    _region(x, w).backward()
    want = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None

    stashed: dict[int, torch.Tensor] = {}
    unstashed: list[int] = []

    def stash(t):
        stashed[len(stashed)] = t.detach().clone()  # the handle: an index; the original is not kept
        return len(stashed) - 1

    def unstash(handle):
        unstashed.append(handle)
        return stashed[handle]

    def contexts():
        return compat.selective_checkpoint_contexts(_policy, stash, unstash)

    out = checkpoint(_region, x, w, use_reentrant=False, context_fn=contexts)
    assert len(stashed) == 2, "both mm outputs are cached through stash"
    assert not unstashed
    out.backward()
    assert sorted(unstashed) == [0, 1], "backward reads every cached output back through unstash"
    assert torch.equal(x.grad, want[0]) and torch.equal(w.grad, want[1])


def test_selective_checkpoint_contexts_refuse_a_torch_without_the_storage_cache(monkeypatch):
    class Bare:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(compat, "create_selective_checkpoint_contexts", lambda policy: (Bare(), Bare()))
    with pytest.raises(RuntimeError, match="storage"):
        compat.selective_checkpoint_contexts(_policy, lambda t: t, lambda h: h)


def test_the_dcp_metadata_this_torch_writes_passes_the_check(tmp_path):
    """What the checked reader admits covers what DCP pickles into ``.metadata`` in this release."""
    import torch.distributed.checkpoint as dcp

    state = {"a@0-6": torch.randn(6), "b@3-9": torch.randn(6, dtype=torch.bfloat16), "c": torch.zeros(2, 3, 4)}
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    assert (tmp_path / compat.DCP_METADATA).is_file()
    compat.check_dcp_metadata(tmp_path / compat.DCP_METADATA)
    checked = compat.CheckedFileSystemReader(tmp_path).read_metadata()
    assert checked.state_dict_metadata == dcp.FileSystemReader(tmp_path).read_metadata().state_dict_metadata


@pytest.mark.parametrize(
    "planted",
    [
        b"cbuiltins\neval\n(S'1'\ntR.",  # a builtin called
        b"ctorch.distributed.checkpoint.filesystem\nos.system\n(S'true'\ntR.",  # a dotted name through a DCP module
        b"ctorch.distributed.checkpoint.filesystem\nos\n.",  # a module a DCP module imported
        b"ctorch\nload\n(S'x'\ntR.",  # a torch function that is not a dtype
        b"ctorch.serialization\nload\n(S'x'\ntR.",  # a function beside the one admitted
    ],
)
def test_the_dcp_metadata_check_refuses_anything_else(tmp_path, planted):
    (tmp_path / compat.DCP_METADATA).write_bytes(planted)
    with pytest.raises(compat.UnsafeCheckpointError, match="refusing to load it"):
        compat.CheckedFileSystemReader(tmp_path).read_metadata()
