"""SlideDPStrategy unit tests: registration, configuration errors and in-process (world size 1) fits."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import StrategyRegistry
from torch.utils.data import DataLoader

import slidedp_lightning
from slidedp_lightning import SlideDPPrecision, SlideDPStrategy
from slidedp_lightning.runtime.lanes.update import UnsupportedOptimizerError
from tests.helpers import rel_err
from tests.trainers import (
    TinyLM,
    adamw,
    data,
    quiet_and_clean,  # noqa: F401  (autouse)
    slidedp_shm,
    trainer,
)

# -- registration and construction ----------------------------------------------------------------------


def test_import_registers_strategies() -> None:
    assert slidedp_lightning.SlideDPStrategy is SlideDPStrategy
    for name in ("slidedp", "slidedp_spawn"):
        assert name in StrategyRegistry
        assert StrategyRegistry[name]["strategy"] is SlideDPStrategy
    assert StrategyRegistry["slidedp_spawn"]["init_params"] == {"start_method": "spawn"}


def test_trainer_builds_with_registered_names() -> None:
    t = L.Trainer(strategy="slidedp", accelerator="cpu", devices=1, logger=False)
    assert isinstance(t.strategy, SlideDPStrategy)
    assert t.strategy._start_method == "popen"
    assert isinstance(t.strategy.precision_plugin, SlideDPPrecision)
    assert t.strategy.precision_plugin.precision == "32-true"
    assert t.strategy.precision_plugin.compute_dtype == torch.float32
    assert t.strategy.engine is None
    t = L.Trainer(strategy="slidedp_spawn", accelerator="cpu", devices=1, logger=False)
    assert isinstance(t.strategy, SlideDPStrategy) and t.strategy._start_method == "spawn"


@pytest.mark.parametrize(
    "device, requested, expected",
    [
        ("cpu", None, "gloo"),
        ("cuda", None, "cpu:gloo,cuda:nccl"),
        ("cuda", "nccl", "cpu:gloo,cuda:nccl"),
        ("cuda", "cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),
        ("cuda", "gloo", "gloo"),
        ("cpu", "gloo", "gloo"),
    ],
)
def test_process_group_backend_reduces_host_tensors_on_cuda(device: str, requested, expected: str) -> None:
    """The runtime reduces host tensors as well as device tensors: on CUDA the group needs gloo beside NCCL."""
    from slidedp_lightning.process.groups import backend_for as process_group_backend_for

    assert process_group_backend_for(torch.device(device), requested) == expected


def test_trainer_bf16_mixed() -> None:
    t = L.Trainer(strategy="slidedp", accelerator="cpu", devices=1, precision="bf16-mixed", logger=False)
    assert isinstance(t.strategy.precision_plugin, SlideDPPrecision)
    assert t.strategy.precision_plugin.compute_dtype == torch.bfloat16


def test_strategy_instance_keeps_options() -> None:
    s = SlideDPStrategy(grad_route="host_reduce", prefetch_window=3, update_threads=2, meta_init=True)
    assert s.options.grad_route == "host_reduce"
    assert s.options.prefetch_window == 3
    assert s.options.update_threads == 2
    assert s.options.meta_init
    t = L.Trainer(strategy=s, accelerator="cpu", devices=1, logger=False)
    assert t.strategy is s


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(grad_route="nope"), "grad_route"),
        (dict(param_route="diagonal"), "param_route"),
        (dict(prefetch_window=0), "prefetch_window"),
        (dict(update_threads=0), "update_threads"),
        (dict(start_method="bogus"), "start_method"),
        (dict(chunk_bytes=0), "chunk_bytes"),
        (dict(chunk_bytes=-4096), "chunk_bytes"),
        (dict(chunk_bytes="big"), "chunk_bytes"),
        (dict(update="sometimes"), "update"),
        (dict(checkpoint_format="zip"), "checkpoint_format"),
        (dict(activation_policy="segments:012"), "segments"),
        (dict(activation_policy="full@2"), "offload"),
        (dict(activation_policy="mostly"), "activation mode"),
        (dict(param_route="replicated", grad_route="host_reduce"), "gpu_reduce"),
        (dict(max_units_in_flight=0), "max_units_in_flight"),
        (dict(meta_init="yes"), "meta_init"),
    ],
)
def test_bad_strategy_config_raises(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        SlideDPStrategy(**kw)
    assert repr(next(iter(kw.values()))) in str(info.value), "the message shows the rejected value"
    assert not dist.is_initialized()


@pytest.mark.parametrize("removed", ["trace_dir", "loss_chunk_tokens", "memory_budget", "restore_module"])
def test_options_that_moved_out_of_the_strategy_are_unknown(removed: str) -> None:
    """Lane tracing is the LaneTrace callback, the chunked loss use_chunked_loss(), the memory budget AutoPolicy's."""
    with pytest.raises(TypeError, match=removed):
        SlideDPStrategy(**{removed: 1})


def test_the_strategy_takes_a_small_typed_surface() -> None:
    import inspect
    import typing

    params = inspect.signature(SlideDPStrategy.__init__).parameters
    # 13 concerns, plus the ledger's two orthogonal compact-state options (optimizer_state, bf16_copy)
    assert len(params) - 1 <= 15, "one concern per option: group or move new knobs (see docs/ARCHITECTURE.md)"
    hints = typing.get_type_hints(SlideDPStrategy.__init__)
    assert typing.get_args(hints["param_route"]) and typing.get_args(hints["host_layout"]) == ("replicated", "sharded")


@pytest.mark.parametrize("precision", ["16-true", "bf16-true", "64-true"])
def test_unsupported_precision_raises(precision: str) -> None:
    with pytest.raises(ValueError, match="32-true") as info:
        L.Trainer(strategy="slidedp", accelerator="cpu", devices=1, precision=precision, logger=False)
    assert "bf16-mixed" in str(info.value)
    assert precision in str(info.value)
    assert not dist.is_initialized()


def test_precision_plugin_rejects_other_names() -> None:
    with pytest.raises(ValueError, match="bf16-mixed"):
        SlideDPPrecision("16-true")


def test_policy_files_that_are_missing_or_malformed_are_refused(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SlideDPStrategy(activation_policy=str(tmp_path / "plan.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"activations": {"default": 5}}')
    with pytest.raises(ValueError, match="activation policy is"):
        SlideDPStrategy(activation_policy=str(bad))
    with pytest.raises(TypeError, match="activation_policy must be"):
        SlideDPStrategy(activation_policy=3.5)


def test_a_policy_for_another_model_is_refused_before_training(tmp_path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text('{"activations": {"default": "none", "units": {"layers.7": "full"}}}')
    module = TinyLM()
    with pytest.raises(ValueError, match="layers.7"):
        trainer(strategy=SlideDPStrategy(activation_policy=str(plan))).fit(module, data())
    assert module.losses == []


@pytest.mark.parametrize("kw", [dict(grad_route="host_reduce"), dict(param_route="auto"), dict(chunk_bytes="auto")])
def test_several_nodes_refuse_what_a_host_cannot_agree_on(kw) -> None:
    with pytest.raises(ValueError, match="nodes") as info:
        L.Trainer(strategy=SlideDPStrategy(**kw), accelerator="cpu", devices=1, num_nodes=2, logger=False)
    assert "gpu_reduce" in str(info.value)
    assert not dist.is_initialized()


def test_host_sharded_layout_needs_the_sharded_parameter_route() -> None:
    with pytest.raises(ValueError, match="param_route='sharded'"):
        SlideDPStrategy(host_layout="sharded")
    with pytest.raises(ValueError, match="host_layout"):
        SlideDPStrategy(host_layout="diagonal")


def test_host_sharded_layout_refuses_whole_parameter_checkpoints() -> None:
    with pytest.raises(ValueError, match="checkpoint_format='distributed'"):
        SlideDPStrategy(param_route="sharded", host_layout="sharded", checkpoint_format="full")


# -- fit-time checks --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, flag",
    [(dict(gradient_clip_val=1.0), "gradient_clip_val"), (dict(plugins=[SlideDPPrecision("16-mixed")]), "16-mixed")],
)
def test_immediate_updates_refuse_what_needs_the_global_norm_before_setup(kw: dict, flag: str) -> None:
    shm_before = slidedp_shm()
    module = TinyLM()
    params_before = {n: p for n, p in module.named_parameters()}
    values_before = {n: p.detach().clone() for n, p in params_before.items()}
    t = trainer(strategy=SlideDPStrategy(update="immediate"), **kw)
    with pytest.raises(ValueError, match=flag):
        t.fit(module, data())
    assert t.strategy.engine is None
    assert module.losses == []
    # no state touched: the very same parameter objects, unchanged, no ledger file
    for n, p in module.named_parameters():
        assert p is params_before[n]
        assert torch.equal(p.detach(), values_before[n])
    assert slidedp_shm() <= shm_before


def test_sgd_raises_unsupported_optimizer_and_restores_module() -> None:
    shm_before = slidedp_shm()
    module = TinyLM("sgd")
    values_before = {n: p.detach().clone() for n, p in module.named_parameters()}
    t = trainer()
    with pytest.raises(UnsupportedOptimizerError, match="SGD"):
        t.fit(module, data())
    assert module.losses == []
    assert t.strategy.engine is None
    # the engine was torn down: ordinary CPU FP32 parameters with the original values, tie kept
    for n, p in module.named_parameters():
        assert p.device.type == "cpu" and p.dtype == torch.float32 and not p.is_meta
        assert torch.equal(p.detach(), values_before[n]), n
    assert module.model.lm_head.weight is module.model.model.embed_tokens.weight
    assert slidedp_shm() <= shm_before


def test_fit_bf16_mixed_streams_bf16_and_keeps_fp32_master() -> None:
    module = TinyLM()
    ref = copy.deepcopy(module.model)
    initial = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    t = trainer(max_steps=3, precision="bf16-mixed")
    t.fit(module, data())
    assert module.param_dtypes == {torch.bfloat16}, "units stream as the ledger's BF16 copy"
    assert {p.dtype for p in module.model.parameters()} == {torch.float32}, "restored from the FP32 master"
    ref_opt = adamw(ref.parameters())
    for batch, loss in zip(module.batches, module.losses):
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_loss = ref(input_ids=batch, labels=batch).loss
        ref_loss.backward()
        ref_opt.step()
        assert abs(loss - ref_loss.item()) <= 2e-3 * abs(ref_loss.item())
    still = [n for n, p in module.model.named_parameters() if torch.equal(p.detach(), initial[n])]
    assert not still, f"parameters never updated: {still}"


def test_fit_matches_plain_adamw() -> None:
    """A whole in-process fit (world size 1): losses and the restored weights equal plain torch AdamW."""
    shm_before = slidedp_shm()
    module = TinyLM()
    ref = copy.deepcopy(module.model)
    t = trainer(max_steps=3)
    t.fit(module, data())
    assert t.global_step == 3
    assert t.strategy.engine is None  # torn down

    # Lightning's distributed sampler shuffles training data: replay the batches the strategy was given
    assert len(module.batches) == 3
    rows = {tuple(r.tolist()) for r in data().dataset}
    assert all(tuple(r.tolist()) in rows for b in module.batches for r in b)
    ref_opt = adamw(ref.parameters())
    ref_losses = []
    for batch in module.batches:
        ref_opt.zero_grad()
        loss = ref(input_ids=batch, labels=batch).loss
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    assert len(module.losses) == 3
    for a, b in zip(module.losses, ref_losses):
        assert abs(a - b) <= 1e-5 * abs(b)
    ref_sd = ref.state_dict()
    for n, p in module.model.named_parameters():
        assert p.device.type == "cpu" and p.dtype == torch.float32
        err = ((p.detach() - ref_sd[n]).abs().max() / ref_sd[n].abs().max()).item()
        assert err <= 1e-5, f"{n}: relative error {err:.3g}"
    assert module.param_dtypes == {torch.float32}
    assert module.model.lm_head.weight is module.model.model.embed_tokens.weight
    assert slidedp_shm() <= shm_before


# -- checkpoints and validation ---------------------------------------------------------------------------


def train_reference(ref: torch.nn.Module, ref_opt, batch_list) -> list[float]:
    losses = []
    for batch in batch_list:
        ref_opt.zero_grad()
        loss = ref(input_ids=batch, labels=batch).loss
        loss.backward()
        ref_opt.step()
        losses.append(loss.item())
    return losses


def test_checkpoint_during_fit_and_resume(tmp_path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = TinyLM()
    ref = copy.deepcopy(module.model)
    ref_opt = adamw(ref.parameters())
    cb = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="ck")
    t = L.Trainer(
        strategy=SlideDPStrategy(checkpoint_format="full"),
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
    )
    t.fit(module, data())
    train_reference(ref, ref_opt, module.batches)
    ckpt = torch.load(tmp_path / "ck.ckpt", weights_only=False)
    assert ckpt["global_step"] == 2
    # the model: FP32 master weights, keyed as the LightningModule's state dict
    ref_sd = ref.state_dict()
    assert ckpt["state_dict"].keys() == {f"model.{k}" for k in ref_sd}
    for k, v in ref_sd.items():
        assert ckpt["state_dict"][f"model.{k}"].dtype == torch.float32
        assert rel_err(ckpt["state_dict"][f"model.{k}"], v) <= 1e-5, k
    # the optimizer: torch AdamW's own format, moments from the ledger
    saved, expected = ckpt["optimizer_states"][0], ref_opt.state_dict()
    assert saved["state"].keys() == expected["state"].keys()
    for i, s in expected["state"].items():
        assert float(saved["state"][i]["step"]) == float(s["step"]) == 2.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert rel_err(saved["state"][i][key], s[key]) <= 1e-5, (i, key)
    assert [len(g["params"]) for g in saved["param_groups"]] == [len(g["params"]) for g in expected["param_groups"]]

    # resume into a module with different initial weights: everything comes from the checkpoint
    if dist.is_initialized():  # the strategy destroys the group it created at teardown
        dist.destroy_process_group()
    resumed = TinyLM()
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)
    t2 = trainer(max_steps=4)
    t2.fit(resumed, data(), ckpt_path=str(tmp_path / "ck.ckpt"))
    assert t2.global_step == 4 and len(resumed.batches) == 2
    ref_losses = train_reference(ref, ref_opt, resumed.batches)
    for a, b in zip(resumed.losses, ref_losses):
        assert abs(a - b) <= 1e-5 * abs(b)
    ref_sd = ref.state_dict()
    for n, p in resumed.model.named_parameters():
        assert rel_err(p.detach(), ref_sd[n]) <= 1e-5, n


def test_distributed_checkpoint_during_fit_resumes_exactly(tmp_path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from slidedp_lightning.checkpoints.distributed import META, read_meta

    module = TinyLM()
    ref = copy.deepcopy(module.model)
    ref_opt = adamw(ref.parameters())
    cb = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="ck")
    t = L.Trainer(
        strategy="slidedp",
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
    )
    t.fit(module, data())
    train_reference(ref, ref_opt, module.batches)
    path = tmp_path / "ck.ckpt"
    assert path.is_dir() and (path / META).is_file() and (path / ".metadata").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary directories left behind"
    meta = read_meta(path)
    assert meta["global_step"] == 2 and meta["slidedp"]["step"] == 2 and "state_dict" not in meta
    if dist.is_initialized():  # the strategy destroys the group it created at teardown
        dist.destroy_process_group()
    resumed = TinyLM()
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)
    t2 = trainer(max_steps=4)
    t2.fit(resumed, data(), ckpt_path=str(path))
    assert t2.global_step == 4 and len(resumed.batches) == 2
    ref_losses = train_reference(ref, ref_opt, resumed.batches)
    for a, b in zip(resumed.losses, ref_losses):
        assert abs(a - b) <= 1e-5 * abs(b)
    ref_sd = ref.state_dict()
    for n, p in resumed.model.named_parameters():
        assert rel_err(p.detach(), ref_sd[n]) <= 1e-5, n


def test_save_checkpoint_after_fit_keeps_optimizer_state_or_refuses(tmp_path) -> None:
    module = TinyLM()
    n_params = sum(1 for _ in module.parameters())
    t = trainer(max_steps=2)
    t.fit(module, data())
    path = tmp_path / "after_fit.ckpt"
    try:
        t.save_checkpoint(path)
    except Exception:
        return  # refusing is acceptable: the moments are gone
    state = torch.load(path, weights_only=False)["optimizer_states"][0]["state"]
    assert len(state) == n_params, "Adam moments missing from the checkpoint"
    assert all(float(s["step"]) == 2.0 for s in state.values())


class ValidatedLM(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.val_losses: list[float] = []

    def validation_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.val_losses.append(loss.item())
        return loss


def test_validation_between_steps_sees_current_weights() -> None:
    """No-grad forwards (sanity check, validation) between training steps stream the current weights."""
    module = ValidatedLM()
    ref = copy.deepcopy(module.model)
    val = DataLoader(data().dataset[:2], batch_size=2)
    t = L.Trainer(
        strategy="slidedp",
        accelerator="cpu",
        devices=1,
        max_steps=4,
        val_check_interval=2,
        num_sanity_val_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    t.fit(module, data(), val)
    assert len(module.batches) == 4
    val_batch = next(iter(val))

    def ref_val() -> float:
        with torch.no_grad():
            return ref(input_ids=val_batch, labels=val_batch).loss.item()

    ref_opt = adamw(ref.parameters())
    expected = [ref_val()]  # sanity check
    for i, batch in enumerate(module.batches, 1):
        (loss,) = train_reference(ref, ref_opt, [batch])
        assert abs(module.losses[i - 1] - loss) <= 1e-5 * abs(loss)
        if i % 2 == 0:
            expected.append(ref_val())
    assert len(module.val_losses) == len(expected) == 3
    for a, b in zip(module.val_losses, expected):
        assert abs(a - b) <= 1e-5 * abs(b)


def test_validate_without_fit() -> None:
    module = ValidatedLM()
    expected = module.model(input_ids=data().dataset[:2], labels=data().dataset[:2]).loss.item()
    values = {n: p.detach().clone() for n, p in module.named_parameters()}
    t = trainer()
    t.validate(module, DataLoader(data().dataset[:2], batch_size=2), verbose=False)
    assert module.val_losses == [pytest.approx(expected, rel=1e-6)]
    for n, p in module.named_parameters():
        assert torch.equal(p.detach(), values[n]), n
    assert module.model.lm_head.weight is module.model.model.embed_tokens.weight


def test_a_users_process_group_without_a_host_backend_is_refused_with_the_fix(monkeypatch, tmp_path) -> None:
    """A group the user made before fit (NCCL alone: no CPU mapping) could not reduce the runtime's host tensors;
    setup says so and how to make one that can. A gloo group (CPU mapped) is accepted."""
    import torch.distributed as dist

    from slidedp_lightning.process import groups as process_groups

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        process_groups.check_host_backend()  # 'cpu:gloo,cuda:gloo'
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
        with pytest.raises(ValueError, match=r"cpu:gloo,cuda:nccl"):
            process_groups.check_host_backend()
        strategy = L.Trainer(strategy="slidedp", accelerator="cpu", devices=1, logger=False).strategy
        with pytest.raises(ValueError, match="cannot reduce the host tensors"):
            strategy.setup_environment()
    finally:
        dist.destroy_process_group()


def _reduce_on_rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from slidedp_lightning.strategy import _all_reduce

    def no_barrier(*args, **kwargs):
        raise AssertionError("strategy.reduce ran a barrier")

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    dist.barrier = no_barrier  # a forked child: the parent's module is untouched
    try:
        x = float(2 * rank + 1)  # 1 on rank 0, 3 on rank 1
        got = {
            op_name: _all_reduce(torch.tensor([x]), None, op).tolist()
            for op_name, op in [("mean", "mean"), ("avg", "avg"), ("sum", "sum"), ("none", None), ("max", "max")]
        }
        got["op"] = _all_reduce(torch.tensor([x]), None, dist.ReduceOp.MIN).tolist()
        got["int_mean"] = _all_reduce(torch.tensor([int(x)]), None, "mean").tolist()
        torch.save(got, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_reduce_of_logged_values_is_one_all_reduce_with_lightnings_results(tmp_path) -> None:
    """``strategy.reduce`` (``self.log(..., sync_dist=True)``) runs one all-reduce, no barrier before it, and gives
    what Lightning's DDP helper gives: mean (summed and divided on gloo), sum, max, a ReduceOp as given."""
    import torch.multiprocessing as mp

    mp.start_processes(
        _reduce_on_rank, args=(str(tmp_path / "store"), str(tmp_path / "out")), nprocs=2, start_method="fork"
    )
    want = {"mean": [2.0], "avg": [2.0], "sum": [4.0], "none": [4.0], "max": [3.0], "op": [1.0], "int_mean": [2]}
    for rank in range(2):
        assert torch.load(tmp_path / f"out.{rank}") == want
