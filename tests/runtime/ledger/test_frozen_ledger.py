"""The ledger of frozen parameters: no Adam moments for them, and a wholly frozen unit keeps a single copy of its
weights (the BF16 copy under bf16 compute, the FP32 master under FP32), as do frozen parameters beside trainable
ones under bf16 compute; reported apart in ``engine.ledger_stats()``; their weights still reach state dicts,
checkpoints and exports."""

from __future__ import annotations

import warnings

import pytest
import torch

from slidedp_lightning.checkpoints import distributed as checkpoint
from slidedp_lightning.runtime.engine import EngineConfig, SlideDPEngine
from slidedp_lightning.runtime.ledger.geometry import PAGE
from tests.helpers import token_batches
from tests.runtime.helpers import aligned_model

CPU = torch.device("cpu")


def engine_of(model: torch.nn.Module, dtype: torch.dtype, **config) -> SlideDPEngine:
    return SlideDPEngine(model, EngineConfig(**config), device=CPU, compute_dtype=dtype)


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.1)


@pytest.mark.parametrize(("dtype", "per_param", "region"), [(torch.bfloat16, 2, "bf16"), (torch.float32, 4, "master")])
def test_a_wholly_frozen_unit_keeps_one_copy_of_its_weights(dtype: torch.dtype, per_param: int, region: str) -> None:
    full = engine_of(aligned_model(), dtype)
    try:
        whole = full.ledger_stats()
    finally:
        full.close(restore=False)
    model = aligned_model()
    model.model.layers[1].requires_grad_(False)
    engine = engine_of(model, dtype)
    try:
        unit = next(u for u in engine.layout.units if u.frozen)
        assert unit.padded == sum(s.numel for s in unit.slots), "the test model is meant to have no padding"
        stats = engine.ledger_stats()
        assert stats.frozen_params == unit.padded and stats.frozen_bytes_per_param <= per_param
        assert stats.frozen_bytes == per_param * unit.padded
        assert stats.trainable_params + stats.frozen_params == stats.num_params
        assert stats.trainable_bytes == 14 * (stats.padded_params - unit.padded)  # every region, padding included
        assert whole.frozen_params == 0 and whole.trainable_params == whole.num_params
        # everything else the same: the file shrinks by what the frozen unit no longer holds, to the page
        saved = (14 - per_param) * unit.padded
        assert abs(whole.nbytes - stats.nbytes - saved) <= 4 * PAGE
        present = {
            r for r in ("master", "exp_avg", "exp_avg_sq", "bf16") if engine.ledger.region(r, unit.index) is not None
        }
        assert present == {region}
    finally:
        engine.close(restore=False)


@pytest.mark.parametrize(("dtype", "per_param"), [(torch.bfloat16, 2), (torch.float32, 6)])
def test_frozen_parameters_beside_trainable_ones_keep_no_moments(dtype: torch.dtype, per_param: int) -> None:
    """A block whose MLP is frozen (as a LoRA block's base weights are): the trainable parameters come first in the
    unit, and its moments (and, under bf16 compute, its FP32 master) end where they do; the frozen MLP keeps its BF16
    copy only under bf16 compute (its master and the BF16 copy under FP32, where the device reads the master)."""
    model = aligned_model()
    model.model.layers[1].mlp.requires_grad_(False)
    weights = {n: t.clone() for n, t in model.state_dict().items()}
    engine = engine_of(model, dtype)
    try:
        unit = next(u for u in engine.layout.units if u.has_frozen)
        assert not unit.frozen and [s.trainable for s in unit.slots] == sorted(
            (s.trainable for s in unit.slots), reverse=True
        ), "trainable parameters first"
        extent = unit.trainable_extent
        frozen = [s for s in unit.slots if not s.trainable]
        assert extent == frozen[0].offset and extent % 1024 == 0 and extent < unit.padded
        assert frozen[-1].end == unit.padded, "the test model is meant to have no padding"
        for region in ("exp_avg", "exp_avg_sq"):
            assert engine.ledger.extent(region, unit.index) == extent
        assert engine.ledger.extent("master", unit.index) == (extent if dtype == torch.bfloat16 else unit.padded)
        assert engine.ledger.extent("bf16", unit.index) == unit.padded
        stats = engine.ledger_stats()
        assert stats.frozen_params == sum(s.numel for s in frozen)
        assert stats.frozen_bytes == per_param * (unit.padded - extent)
        assert stats.trainable_bytes == 14 * (stats.padded_params - (unit.padded - extent))
        opt = adamw(model)
        engine.attach_optimizer(opt)
        _train(engine, model, opt, token_batches(2, 2, 16, vocab=256))
        after = engine.state_dict()
        for name, value in after.items():
            if ".layers.1.mlp." in name:  # untouched: the BF16 copy of the initial weights under bf16 compute
                want = weights[name].to(torch.bfloat16).float() if dtype == torch.bfloat16 else weights[name]
                assert torch.equal(value, want), name
            elif name.endswith("proj.weight"):
                assert not torch.equal(value, weights[name]), f"{name} did not train"
    finally:
        engine.close(restore=False)


def _train(engine: SlideDPEngine, model: torch.nn.Module, opt: torch.optim.Optimizer, batches) -> list[float]:
    losses = []
    for x in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        assert engine.end_step()
        losses.append(loss.item())
    return losses


def frozen_model(seed: int) -> torch.nn.Module:
    """Frozen embeddings, a frozen middle block and the frozen MLP of the first block."""
    model = aligned_model(seed=seed)
    model.model.embed_tokens.requires_grad_(False)
    model.model.layers[1].requires_grad_(False)
    model.model.layers[0].mlp.requires_grad_(False)
    return model


def test_frozen_weights_without_a_master_reach_checkpoints_and_exports_and_resume(tmp_path) -> None:
    """bf16 compute, frozen embeddings, a frozen middle block and the frozen MLP of the first block: the checkpoint
    holds their weights (the BF16 copy in FP32) and no moments for them; a fresh engine loading it continues exactly
    as the one that saved it."""

    model = frozen_model(0)
    initial = {n: t.clone() for n, t in model.state_dict().items()}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    batches = token_batches(4, 2, 16, vocab=256)
    engine = engine_of(model, torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group
        try:
            assert sum(u.frozen for u in engine.layout.units) == 2
            opt = adamw(model)
            engine.attach_optimizer(opt)
            _train(engine, model, opt, batches[:2])
            exported = engine.state.model_tensors(engine.model)
            for name in frozen:  # exports: the frozen weights, from their BF16 copy
                assert torch.equal(exported[name], initial[name].to(torch.bfloat16).float()), name
            checkpoint.save(engine, {"state_dict": {}}, tmp_path / "ck")
            opt_state = engine.optimizer_state_dict(opt)
            assert len(opt_state["state"]) == len([p for p in model.parameters() if p.requires_grad])
            after = _train(engine, model, opt, batches[2:])
            want = engine.state_dict()
        finally:
            engine.close(restore=False)
        stored = {
            k.split("@")[0]
            for k in checkpoint.CheckedFileSystemReader(tmp_path / "ck").read_metadata().state_dict_metadata
        }
        assert {f"model/{n}" for n in frozen} <= stored
        assert not any(k.startswith("exp_avg") and k.split("/", 1)[1] in frozen for k in stored)
        other = frozen_model(7)  # other initial weights: everything must come from the checkpoint
        engine = engine_of(other, torch.bfloat16)
        try:
            opt = adamw(other)
            engine.attach_optimizer(opt)
            checkpoint.load(engine, tmp_path / "ck")
            assert engine.step == 2
            assert _train(engine, other, opt, batches[2:]) == after
            got = engine.state_dict()
        finally:
            engine.close(restore=False)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_frozen_weights_beside_a_master_on_disk_train_save_and_resume_as_in_memory(tmp_path) -> None:
    """The master on disk covers the trainable parameters only: frozen embeddings, a frozen block and a frozen MLP
    keep their BF16 copy in memory; the same losses, weights, export and checkpoint as the ledger in memory."""

    batches = token_batches(4, 2, 16, vocab=256)
    runs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group
        for where in ("memory", "disk"):
            (tmp_path / where).mkdir()
            disk = {"state_dir": str(tmp_path / where), "master_on_disk": True} if where == "disk" else {}
            model = frozen_model(0)
            engine = engine_of(model, torch.bfloat16, **disk)
            try:
                opt = adamw(model)
                engine.attach_optimizer(opt)
                losses = _train(engine, model, opt, batches[:2])
                checkpoint.save(engine, {"state_dict": {}}, tmp_path / f"ck-{where}")
                losses += _train(engine, model, opt, batches[2:])
                runs[where] = (losses, engine.state_dict(), engine.state.model_tensors(engine.model))
            finally:
                engine.close(restore=False)
        (memory, disk_run) = runs["memory"], runs["disk"]
        assert disk_run[0] == memory[0]
        for a, b in ((disk_run[1], memory[1]), (disk_run[2], memory[2])):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        other = frozen_model(7)  # the disk run's checkpoint, resumed into memory
        engine = engine_of(other, torch.bfloat16)
        try:
            opt = adamw(other)
            engine.attach_optimizer(opt)
            checkpoint.load(engine, tmp_path / "ck-disk")
            assert _train(engine, other, opt, batches[2:]) == memory[0][2:]
            assert all(torch.equal(v, memory[1][k]) for k, v in engine.state_dict().items())
        finally:
            engine.close(restore=False)
