"""SlideDPEngine on a tiny Qwen3, one process, CPU: exactness against torch's optimizers, setup errors, meta init,
teardown and unit residency."""

from __future__ import annotations

import copy
import glob

import pytest
import torch
from torch import nn
from transformers import Qwen3ForCausalLM

from slidedp_lightning.models import UnsupportedModelError
from slidedp_lightning.runtime.engine import EngineConfig, SlideDPEngine, check_stream_concurrency
from slidedp_lightning.runtime.lanes.update import UnsupportedOptimizerError
from slidedp_lightning.runtime.ledger.memory import PrivateLedgerMemory
from slidedp_lightning.runtime.ledger.pages import PAGE, lock_ranges
from tests.helpers import (
    rel_err,
    tiny_config,
    tiny_model,
)
from tests.runtime.helpers import CPU, adamw_groups, assert_rel_close, batches, loss_of, make_engine, train_pair

# -- (a), (b): FP32 AdamW exactness and the BF16 transfer copy ------------------------------------------


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("route", ["gpu_reduce", "host_reduce"])
def test_fp32_adamw_matches_torch(engines, route: str, window: int, tied: bool) -> None:
    model = tiny_model(tied)
    ref = copy.deepcopy(model)
    engine = engines(model, grad_route=route, prefetch_window=window)
    opt = adamw_groups(model)
    engine.attach_optimizer(opt)
    ref_opt = adamw_groups(ref)

    losses, ref_losses = train_pair(model, engine, ref, opt, ref_opt, steps=10, lr_drop_at=5)

    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert engine.step == 10
    assert_rel_close(engine.state_dict(), ref.state_dict())
    # the weights moved (a broken update that does nothing would otherwise match a lr=0 reference)
    initial = tiny_model(tied).model.layers[0].mlp.up_proj.weight
    assert rel_err(engine.state_dict()["model.layers.0.mlp.up_proj.weight"], initial) > 1e-3

    # Adam moments and the step count, in torch's optimizer.state_dict() form
    ours, theirs = engine.optimizer_state_dict(opt), ref_opt.state_dict()
    assert ours["state"].keys() == theirs["state"].keys()
    for i, s in theirs["state"].items():
        assert float(ours["state"][i]["step"]) == float(s["step"]) == 10.0
        assert_rel_close(
            {k: ours["state"][i][k] for k in ("exp_avg", "exp_avg_sq")}, {k: s[k] for k in ("exp_avg", "exp_avg_sq")}
        )
    assert [g["lr"] for g in ours["param_groups"]] == [g["lr"] for g in theirs["param_groups"]]

    # (b) the BF16 transfer copy is the master rounded to BF16, bit for bit (gaps and padding included)
    engine.synchronize()
    led = engine.ledger
    assert torch.equal(led.bf16.view(torch.int16), led.master.to(torch.bfloat16).view(torch.int16))
    # alignment gaps and padding stay zero in the master and in the moments
    for unit in engine.layout.units:
        for a, b in unit.gaps():
            lo, hi = unit.offset + a, unit.offset + b
            assert not led.master[lo:hi].any() and not led.exp_avg[lo:hi].any() and not led.exp_avg_sq[lo:hi].any()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("route", ["gpu_reduce", "host_reduce"])
def test_bf16_compute_matches_torch_step_by_step(route: str, tied: bool) -> None:
    """BF16 units (the ledger's transfer copy), BF16 gradients, FP32 master: each step equals torch AdamW on an
    FP32 master whose BF16 copy computed the gradients. The reference restarts from the engine's state after each
    step, because a one-ulp FP32 difference that crosses a BF16 rounding boundary is amplified 2^16-fold."""
    model = tiny_model(tied)
    master = copy.deepcopy(model)
    work = copy.deepcopy(model)  # BF16 parameters, FP32 buffers (rotary frequencies), as the engine computes
    for p in work.parameters():
        p.data = p.data.to(torch.bfloat16)
    engine = SlideDPEngine(model, EngineConfig(grad_route=route), device=CPU, compute_dtype=torch.bfloat16)
    try:
        opt, ref_opt = adamw_groups(model), adamw_groups(master)
        engine.attach_optimizer(opt)
        for x in batches(4):
            loss = loss_of(model, x)
            assert model.lm_head.weight.dtype == torch.bfloat16
            loss.backward()
            assert engine.end_step()
            with torch.no_grad():
                for p, q in zip(master.parameters(), work.parameters()):
                    q.copy_(p)
            work.zero_grad()
            ref_loss = loss_of(work, x)
            ref_loss.backward()
            for p, q in zip(master.parameters(), work.parameters()):
                p.grad = q.grad.float()
            ref_opt.step()
            assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
            assert_rel_close(engine.state_dict(), master.state_dict())
            led = engine.ledger
            assert torch.equal(led.bf16.view(torch.int16), led.master.to(torch.bfloat16).view(torch.int16))
            master.load_state_dict(engine.state_dict())
            ref_opt.load_state_dict(engine.optimizer_state_dict(opt))
    finally:
        engine.close()


# -- (c): Adam with L2 weight decay -------------------------------------------------------------------------


@pytest.mark.parametrize("decoupled", [False, True], ids=["l2", "decoupled"])
@pytest.mark.parametrize("route", ["gpu_reduce", "host_reduce"])
def test_adam_matches_torch(engines, route: str, decoupled: bool) -> None:
    """torch.optim.Adam with weight_decay > 0 (L2, coupled), and with decoupled_weight_decay=True (AdamW)."""
    model = tiny_model(tied=True)
    ref = copy.deepcopy(model)
    engine = engines(model, grad_route=route)
    extra = {"decoupled_weight_decay": True} if decoupled else {}

    def make(m):
        return torch.optim.Adam(m.parameters(), lr=2e-3, betas=(0.9, 0.99), eps=1e-7, weight_decay=0.05, **extra)

    opt, ref_opt = make(model), make(ref)
    engine.attach_optimizer(opt)
    losses, ref_losses = train_pair(model, engine, ref, opt, ref_opt, steps=6)
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert_rel_close(engine.state_dict(), ref.state_dict())


def test_adam_l2_differs_from_adamw(engines) -> None:
    """Guards the test above: coupled (L2) and decoupled decay really give different weights here."""
    model = tiny_model(tied=True)
    ref = copy.deepcopy(model)
    engine = engines(model)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3, betas=(0.9, 0.99), eps=1e-7, weight_decay=0.05)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=2e-3, betas=(0.9, 0.99), eps=1e-7, weight_decay=0.05)
    engine.attach_optimizer(opt)
    train_pair(model, engine, ref, opt, ref_opt, steps=6)
    sd, ref_sd = engine.state_dict(), ref.state_dict()
    assert max(rel_err(sd[k], ref_sd[k]) for k in sd) > 1e-4


# -- (d): optimizer validation ---------------------------------------------------------------------------


def test_sgd_is_rejected(engines) -> None:
    model = tiny_model()
    engine = engines(model)
    with pytest.raises(UnsupportedOptimizerError, match="SGD"):
        engine.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize(
    "make, flag",
    [
        (lambda ps: torch.optim.AdamW(ps, amsgrad=True), "amsgrad"),
        (lambda ps: torch.optim.Adam(ps, maximize=True), "maximize"),
    ],
    ids=["amsgrad", "maximize"],
)
def test_unsupported_flags_are_rejected(engines, make, flag: str) -> None:
    model = tiny_model()
    engine = engines(model)
    with pytest.raises(UnsupportedOptimizerError, match=flag):
        engine.attach_optimizer(make(model.parameters()))


def test_unsupported_optimizer_error_is_a_value_error() -> None:
    assert issubclass(UnsupportedOptimizerError, ValueError)


def test_optimizer_missing_parameters_raises(engines) -> None:
    model = tiny_model()
    engine = engines(model)
    some = [p for n, p in model.named_parameters() if "layers.1." not in n]
    with pytest.raises(ValueError, match="not in the optimizer") as info:
        engine.attach_optimizer(torch.optim.AdamW(some))
    assert "model.layers.1." in str(info.value)


def test_optimizer_built_before_the_engine_raises(engines) -> None:
    """The engine replaces the parameters; an optimizer holding the old ones would train nothing."""
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters())
    engine = engines(model)
    with pytest.raises(ValueError, match="not in the optimizer"):
        engine.attach_optimizer(opt)


def test_gradients_without_optimizer_raise(engines) -> None:
    model = tiny_model()
    engines(model)
    x = batches(1)[0]
    with pytest.raises(RuntimeError, match="no optimizer is attached"):
        loss_of(model, x).backward()


# -- (f): meta-device init ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_meta_init(engines, tied: bool) -> None:
    with torch.device("meta"):
        model = Qwen3ForCausalLM(tiny_config(tied))
    assert model.model.embed_tokens.weight.is_meta and model.model.rotary_emb.inv_freq.is_meta
    engine = engines(model)
    sd = engine.state_dict()
    assert all(torch.isfinite(v).all() for v in sd.values())
    assert sd.keys() == tiny_model(tied).state_dict().keys()

    norms = [n for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) == 2 * 4 + 1  # per layer: input, post-attention, q_norm, k_norm; plus the final norm
    for name in norms:
        assert torch.equal(sd[f"{name}.weight"], torch.ones_like(sd[f"{name}.weight"])), name
    std = tiny_config(tied).initializer_range
    for name, value in sd.items():
        if value.ndim == 2:  # initialized as the model would (normal(0, initializer_range)), not left empty
            assert 0.75 * std < value.std().item() < 1.25 * std, name

    cpu_model = tiny_model(tied)
    rot, cpu_rot = model.model.rotary_emb, cpu_model.model.rotary_emb
    assert not rot.inv_freq.is_meta
    assert torch.equal(rot.inv_freq, cpu_rot.inv_freq)
    assert torch.equal(rot.original_inv_freq, cpu_rot.original_inv_freq)
    assert rot.attention_scaling == cpu_rot.attention_scaling
    assert not any(b.is_meta for b in model.buffers())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied

    # it trains like a CPU-built copy of the same weights
    ref = tiny_model(tied)
    ref.load_state_dict(sd)
    opt, ref_opt = adamw_groups(model), adamw_groups(ref)
    engine.attach_optimizer(opt)
    losses, ref_losses = train_pair(model, engine, ref, opt, ref_opt, steps=2)
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert_rel_close(engine.state_dict(), ref.state_dict())


# -- (g): teardown ------------------------------------------------------------------------------------------


def _slidedp_shm() -> set[str]:
    return set(glob.glob("/dev/shm/slidedp-*"))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_close_restores_cpu_parameters(tied: bool, monkeypatch) -> None:
    monkeypatch.delenv("SLIDEDP_SHM_DIR", raising=False)  # set, it would put even a private ledger there
    shm_before = _slidedp_shm()
    model = tiny_model(tied)
    engine = make_engine(model)
    assert isinstance(engine.ledger.file, PrivateLedgerMemory), "one local rank: the ledger is private memory"
    assert engine.ledger.file.fd is None and _slidedp_shm() <= shm_before, "nothing of it is in /dev/shm"
    engine.attach_optimizer(adamw_groups(model))
    for x in batches(3):
        loss_of(model, x).backward()
        engine.end_step()
    final = engine.state_dict()
    engine.close(restore=True)
    engine.close(restore=True)  # idempotent

    assert engine.ledger.master is None
    assert engine.ledger.file.fd is None  # closed with the engine
    assert _slidedp_shm() <= shm_before
    params = dict(model.named_parameters())
    assert params.keys() <= final.keys()
    for name, p in params.items():
        assert type(p) is nn.Parameter and p.requires_grad
        assert p.device.type == "cpu" and p.dtype == torch.float32
        assert p.untyped_storage().nbytes() == p.numel() * 4, f"{name} is an independent copy, not a ledger view"
        assert torch.equal(p.detach(), final[name]), name
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks, "engine hooks are removed"
    # the module works as an ordinary model again: plain autograd and a torch optimizer
    opt = torch.optim.AdamW(model.parameters())
    loss_of(model, batches(1)[0]).backward()
    assert all(p.grad is not None for p in model.parameters())
    opt.step()


def test_close_without_restore_leaves_meta() -> None:
    model = tiny_model()
    engine = make_engine(model)
    engine.close(restore=False)
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_close_auto_restores_only_when_copies_fit(monkeypatch) -> None:
    import slidedp_lightning.runtime.engine as engine_module

    model = tiny_model()
    engine = make_engine(model)
    final = engine.state_dict()
    engine.close()  # default "auto": a tiny model fits
    assert all(not p.is_meta for p in model.parameters())
    assert torch.equal(model.model.norm.weight.detach(), final["model.norm.weight"])

    model = tiny_model()
    engine = make_engine(model)
    monkeypatch.setattr(engine_module, "available_host_bytes", lambda: (1000, 1000))
    engine.close()  # "auto" with (pretend) no free host memory: meta tensors instead of copies
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight


# -- setup errors -------------------------------------------------------------------------------------------


def test_extra_parameter_next_to_the_model_rejected() -> None:
    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_model()
            self.probe = nn.Linear(64, 2)

    with pytest.raises(UnsupportedModelError, match="probe.weight"):
        make_engine(LM())


def test_engine_finds_model_inside_wrapper(engines) -> None:
    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_model()

    root = LM()
    ref = copy.deepcopy(root.net)
    engine = engines(root)
    assert engine.model is root.net
    opt, ref_opt = adamw_groups(root), adamw_groups(ref)
    engine.attach_optimizer(opt)
    x = batches(1)[0]
    loss_of(root.net, x).backward()
    engine.end_step()
    ref_opt.zero_grad()
    loss_of(ref, x).backward()
    ref_opt.step()
    sd = engine.state_dict()
    assert_rel_close({k.removeprefix("net."): v for k, v in sd.items()}, ref.state_dict())


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(grad_route="nope"), "grad_route"),
        (dict(param_route="diagonal"), "param_route"),
        (dict(prefetch_window=0), "prefetch_window"),
        (dict(update_threads=0), "update_threads"),
        (dict(staging_slots=0), "staging_slots"),
    ],
)
def test_engine_config_validation(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_explicit_routes_are_used_as_given_without_the_probe(monkeypatch) -> None:
    from slidedp_lightning.runtime import engine as engine_module

    def no_probe(*args, **kwargs):
        raise AssertionError("the route probe ran for explicit routes")

    monkeypatch.setattr(engine_module, "resolve_auto_routes", no_probe)
    config = EngineConfig(param_route="full", grad_route="host_reduce", chunk_bytes=4096)
    assert not config.auto_routes
    assert all(EngineConfig(**{k: "auto"}).auto_routes for k in ("param_route", "grad_route", "chunk_bytes"))
    engine = make_engine(tiny_model(), param_route="full", grad_route="host_reduce", chunk_bytes=4096)
    try:
        got = engine.config
        assert (got.param_route, got.grad_route, got.chunk_bytes) == ("full", "host_reduce", 4096)
        assert engine.route_probe is None
    finally:
        engine.close()


def test_one_cuda_connection_is_refused_only_where_threads_issue_collectives(monkeypatch) -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(ValueError, match="Unset CUDA_DEVICE_MAX_CONNECTIONS, or use param_route='full'"):
        check_stream_concurrency(cuda, threads_issue_collectives=True)
    check_stream_concurrency(cuda, threads_issue_collectives=False)  # the full route: one thread's collectives
    check_stream_concurrency(cpu, threads_issue_collectives=True)  # no streams
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    check_stream_concurrency(cuda, threads_issue_collectives=True)


# -- checkpoint round trip ----------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["gpu_reduce", "host_reduce"])
def test_resume_from_state_dicts_matches_uninterrupted(engines, route: str) -> None:
    model = tiny_model(tied=True)
    ref = copy.deepcopy(model)
    fresh = tiny_model(tied=True, seed=7)  # different initial weights: everything must come from the checkpoint
    ref_opt = adamw_groups(ref)
    engine = engines(model, grad_route=route)
    opt = adamw_groups(model)
    engine.attach_optimizer(opt)
    data = batches(6)
    for x in data[:3]:
        loss_of(model, x).backward()
        engine.end_step()
    weights, opt_state = engine.state_dict(), engine.optimizer_state_dict(opt)
    engine.close()

    engine2 = engines(fresh, grad_route=route)
    opt2 = adamw_groups(fresh)
    engine2.attach_optimizer(opt2)
    engine2.load_state_dict(weights)
    engine2.load_optimizer_state_dict(opt2, opt_state)
    assert engine2.step == 3
    assert_rel_close(engine2.state_dict(), weights, tol=0.0)
    led = engine2.ledger
    assert torch.equal(led.bf16.view(torch.int16), led.master.to(torch.bfloat16).view(torch.int16))
    losses = []
    for x in data[3:]:
        loss = loss_of(fresh, x)
        loss.backward()
        engine2.end_step()
        losses.append(loss.item())

    ref_losses = []
    for x in data:
        ref_opt.zero_grad()
        loss = loss_of(ref, x)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    for a, b in zip(losses, ref_losses[3:]):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert_rel_close(engine2.state_dict(), ref.state_dict())


def test_load_state_dict_strict_reports_mismatch(engines) -> None:
    model = tiny_model()
    engine = engines(model)
    sd = engine.state_dict()
    sd.pop("model.norm.weight")
    sd["bogus"] = torch.zeros(1)
    with pytest.raises(KeyError, match="model.norm.weight"):
        engine.load_state_dict(sd)
    bad = engine.state_dict()
    bad["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        engine.load_state_dict(bad)


def _region_pages(engine: SlideDPEngine, name: str) -> set[int]:
    whole = getattr(engine.ledger, name)
    a = whole.data_ptr() - engine.ledger.mapping_address()
    return set(range(a // PAGE, -(-(a + whole.numel() * whole.element_size()) // PAGE)))


@pytest.mark.parametrize(
    "dtype, cfg, region",
    [
        (torch.bfloat16, {}, "bf16"),  # fills read the BF16 copy
        (torch.float32, {}, "master"),  # FP32 compute reads the master
        (torch.bfloat16, {"bf16_copy": False, "h2d_convert": "device"}, "master"),  # FP32 over the link
        (torch.bfloat16, {"bf16_copy": False, "h2d_convert": "host"}, None),  # via the (pinned) staging buffer
        (torch.bfloat16, {"grad_route": "host_reduce"}, "bf16"),  # + this rank's staging row
    ],
)
def test_the_ledger_memory_device_copies_use_is_what_gets_page_locked(dtype, cfg, region) -> None:
    """On CUDA the engine page-locks engine.dma_views(): the fill sources (and the staging row), never the moments,
    so pinning faults in no page the device does not copy (a host-sharded ledger would otherwise fill up)."""
    engine = SlideDPEngine(tiny_model(False), EngineConfig(**cfg), device=CPU, compute_dtype=dtype)
    try:
        ranges = lock_ranges(engine.ledger, engine.dma_views())
        pages = {p for a, b in ranges for p in range(a // PAGE, b // PAGE)}
        staging = _region_pages(engine, "staging") if cfg.get("grad_route") == "host_reduce" else set()
        want = (_region_pages(engine, region) if region else set()) | staging
        assert pages == want
        for moment in ("exp_avg", "exp_avg_sq"):
            assert not pages & _region_pages(engine, moment)
    finally:
        engine.close()
