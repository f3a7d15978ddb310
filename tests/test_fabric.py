"""``Fabric(strategy="slidedp")``: registration, optimizer remapping, refusals and clipping in-process (one device),
and a two-rank Fabric loop against Fabric DDP + ``torch.optim.AdamW`` with a bit-exact resume (subprocess jobs,
``tests/integration/fabric_job.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY

import slidedp_lightning
from slidedp_lightning import SlideDPFabricPrecision, SlideDPFabricStrategy
from slidedp_lightning.runtime.lanes.update import UnsupportedOptimizerError
from tests.helpers import nanogpt, token_batches
from tests.integration.conftest import JobServer
from tests.trainers import adamw, quiet_and_clean  # noqa: F401  (autouse)

JOB = Path(__file__).parent / "integration" / "fabric_job.py"
STEPS, SAVE_AT, RTOL = 20, 10, 1e-4


@pytest.fixture
def fabrics():
    """``make(**kw)``: a launched one-device Fabric on SlideDP; every strategy made is torn down after the test."""
    made: list[L.Fabric] = []

    def make(precision: str = "32-true", plugins=None, **strategy_kw) -> L.Fabric:
        strategy = SlideDPFabricStrategy(**strategy_kw) if strategy_kw else "slidedp"
        kw = {"plugins": plugins} if plugins is not None else {"precision": precision}
        fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=1, **kw)
        fabric.launch()
        made.append(fabric)
        return fabric

    yield make
    for fabric in made:
        fabric.strategy.teardown()


def steps(fabric, model, opt, batches, clip: dict | None = None) -> list[float]:
    losses = []
    for b in batches:
        loss = model(b, b)[1]
        fabric.backward(loss)
        if clip:
            fabric.clip_gradients(model, opt, **clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def reference(model, batches, clip: dict | None = None) -> tuple[list[float], list[float]]:
    """Plain torch: losses and (clipping by norm) the global norms torch's clip_grad_norm_ returns."""
    opt = adamw(model.parameters())
    losses, norms = [], []
    for b in batches:
        loss = model(b, b)[1]
        loss.backward()
        if clip and "max_norm" in clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip["max_norm"]).item())
        elif clip:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip["clip_val"])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def close(a: list[float], b: list[float], rtol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b))


def weights_rel_err(key: str, got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|; of an attention's fused qkv bias, the query and value thirds only (the key
    third gets no gradient but rounding noise, which Adam turns into full-size steps of either sign)."""
    if key.endswith("attn.c_attn.bias"):
        width = got.numel() // 3
        got, want = torch.cat([got[:width], got[2 * width :]]), torch.cat([want[:width], want[2 * width :]])
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


# -- registration and construction ----------------------------------------------------------------------


def test_import_registers_the_fabric_strategy() -> None:
    assert slidedp_lightning.SlideDPFabricStrategy is SlideDPFabricStrategy
    for name in ("slidedp", "slidedp_spawn"):
        assert STRATEGY_REGISTRY[name]["strategy"] is SlideDPFabricStrategy
    assert STRATEGY_REGISTRY["slidedp_spawn"]["init_params"] == {"start_method": "spawn"}
    fabric = L.Fabric(strategy="slidedp", accelerator="cpu", devices=1, precision="bf16-mixed")
    assert isinstance(fabric.strategy, SlideDPFabricStrategy) and fabric.strategy.engine is None
    assert isinstance(fabric.strategy.precision, SlideDPFabricPrecision)
    assert fabric.strategy.precision.compute_dtype == torch.bfloat16


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: L.Fabric(strategy="slidedp", accelerator="cpu", devices=1, precision="bf16-true"), "bf16-true"),
        (lambda: L.Fabric(strategy="slidedp", accelerator="cpu", devices=1, precision="64-true"), "64-true"),
        (lambda: SlideDPFabricStrategy(prefetch_window=0), "prefetch_window"),
        (lambda: SlideDPFabricStrategy(accumulate_grad_batches=0), "accumulate_grad_batches"),
        (lambda: SlideDPFabricStrategy(start_method="thread"), "start_method"),
    ],
    ids=["bf16-true", "64-true", "option", "accumulate", "start_method"],
)
def test_what_cannot_be_configured_is_refused(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_an_unknown_option_is_refused() -> None:
    with pytest.raises(TypeError, match="grad_rout"):
        SlideDPFabricStrategy(grad_rout="host_reduce")


# -- the model and the optimizer ------------------------------------------------------------------------


def test_an_optimizer_made_before_setup_is_remapped_by_name(fabrics) -> None:
    """The usual Fabric order: the optimizer holds the parameters the engine then replaces; after setup its groups
    hold the streamed parameters (tied ones once), hyper-parameters kept, and training equals plain torch."""
    fabric = fabrics()
    model, ref = nanogpt(0), nanogpt(0)
    opt = adamw(model.parameters())
    model, opt = fabric.setup(model, opt)
    current = {id(p) for p in model.parameters()}
    assert all(id(p) in current for g in opt.param_groups for p in g["params"])
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    batches = token_batches(4, 2, 16)
    got, (want, _) = steps(fabric, model, opt, batches), reference(ref, batches)
    assert close(got, want), (got, want)
    assert fabric.strategy.engine.step == 4


def test_setup_module_then_setup_optimizers(fabrics) -> None:
    fabric = fabrics()
    model, ref = nanogpt(0), nanogpt(0)
    model = fabric.setup_module(model)
    opt = fabric.setup_optimizers(adamw(model.parameters()))
    batches = token_batches(3, 2, 16)
    assert close(steps(fabric, model, opt, batches), reference(ref, batches)[0])


def test_an_optimizer_that_has_state_is_refused(fabrics) -> None:
    fabric = fabrics()
    model = nanogpt(0)
    opt = adamw(model.parameters())
    b = token_batches(1, 2, 16)[0]
    model(b, b)[1].backward()
    opt.step()
    with pytest.raises(ValueError, match="already has state"):
        fabric.setup(model, opt)


def test_a_second_optimizer_or_model_is_refused(fabrics) -> None:
    fabric = fabrics()
    model = nanogpt(0)
    with pytest.raises(ValueError, match="exactly one optimizer"):
        fabric.setup(model, adamw(model.parameters()), adamw(model.parameters()))
    model = fabric.setup_module(model)
    fabric.setup_optimizers(adamw(model.parameters()))
    with pytest.raises(ValueError, match="exactly one optimizer"):
        fabric.setup_optimizers(adamw(model.parameters()))
    with pytest.raises(ValueError, match="one model per process"):
        fabric.setup(nanogpt(1))


def test_what_the_cpu_update_cannot_run_is_refused(fabrics) -> None:
    fabric = fabrics()
    with pytest.raises(RuntimeError, match="set up the model before the optimizer"):
        fabric.setup_optimizers(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()))
    model = nanogpt(0)
    with pytest.raises(UnsupportedOptimizerError, match="SGD"):
        fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_no_backward_sync_needs_accumulate_grad_batches(fabrics) -> None:
    fabric = fabrics()
    model = fabric.setup_module(nanogpt(0))
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        fabric.no_backward_sync(model, enabled=True)
    with fabric.no_backward_sync(model, enabled=False):
        pass


def test_accumulation_under_no_backward_sync_equals_torch(fabrics) -> None:
    """LitGPT's accumulation loop: no_backward_sync on all but the last micro-batch, a step every 2."""
    fabric = fabrics(accumulate_grad_batches=2)
    model, ref = nanogpt(0), nanogpt(0)
    model, opt = fabric.setup(model, adamw(model.parameters()))
    ref_opt = adamw(ref.parameters())
    batches = token_batches(6, 2, 16)
    for i, b in enumerate(batches):
        accumulating = i % 2 == 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            fabric.backward(model(b, b)[1] / 2)
        (ref(b, b)[1] / 2).backward()
        if not accumulating:
            opt.step()
            ref_opt.step()
            ref_opt.zero_grad()
    want = ref.state_dict()
    got = fabric.strategy.engine.state_dict()
    for k in want:
        assert weights_rel_err(k, got[k], want[k]) <= 1e-5, k
    assert fabric.strategy.engine.step == 3


# -- clipping -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("clip", [{"max_norm": 0.5}, {"clip_val": 0.01}], ids=["norm", "value"])
def test_clip_gradients_equals_torch_and_returns_the_global_norm(fabrics, clip: dict) -> None:
    fabric = fabrics()  # update="auto": deferred under Fabric, so clip_gradients can come at any step
    model, ref = nanogpt(0), nanogpt(0)
    model, opt = fabric.setup(model, adamw(model.parameters()))
    batches = token_batches(4, 2, 16)
    want, norms = reference(ref, batches, clip)
    got, got_norms = [], []
    for b in batches:
        loss = model(b, b)[1]
        fabric.backward(loss)
        norm = fabric.clip_gradients(model, opt, **clip)
        assert (norm is None) == ("clip_val" in clip)
        if norm is not None:
            got_norms.append(norm.item())
            assert norm.dtype == torch.float32 and norm.item() == pytest.approx(fabric.strategy.last_grad_norm)
        opt.step()
        opt.zero_grad()
        got.append(loss.item())
    assert close(got, want), (got, want)
    assert close(got_norms, norms), (got_norms, norms)


def test_clip_gradients_refusals(fabrics) -> None:
    fabric = fabrics(update="immediate")
    model, opt = fabric.setup(*_model_and_opt())
    b = token_batches(1, 2, 16)[0]
    fabric.backward(model(b, b)[1])
    with pytest.raises(RuntimeError, match="update='immediate'"):
        fabric.clip_gradients(model, opt, max_norm=1.0)
    opt.step()


def test_clip_gradients_norm_type_and_order(fabrics) -> None:
    fabric = fabrics()
    model, opt = fabric.setup(*_model_and_opt())
    b = token_batches(1, 2, 16)[0]
    fabric.backward(model(b, b)[1])
    with pytest.raises(ValueError, match="norm_type"):
        fabric.clip_gradients(model, opt, max_norm=1.0, norm_type="inf")
    fabric.clip_gradients(model, opt, max_norm=1.0)
    with pytest.raises(RuntimeError, match="optimizer.step"):
        fabric.backward(model(b, b)[1])
    opt.step()


def test_a_non_finite_norm_raises_and_the_step_is_skipped(fabrics) -> None:
    fabric = fabrics()
    model, opt = fabric.setup(*_model_and_opt())
    before = fabric.strategy.engine.state_dict()
    b = token_batches(1, 2, 16)[0]
    fabric.backward(model(b, b)[1] * float("nan"))
    with pytest.raises(RuntimeError, match="non-finite"):
        fabric.clip_gradients(model, opt, max_norm=1.0)
    opt.step()
    assert fabric.strategy.engine.step == 0
    after = fabric.strategy.engine.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def _model_and_opt():
    model = nanogpt(0)
    return model, adamw(model.parameters())


# -- checkpoints in-process: the full format ------------------------------------------------------------


def test_full_checkpoint_round_trip(fabrics, tmp_path: Path) -> None:
    fabric = fabrics(checkpoint_format="full")
    model, opt = fabric.setup(*_model_and_opt())
    batches = token_batches(4, 2, 16)
    steps(fabric, model, opt, batches[:2])
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": opt, "step": 2})
    want = steps(fabric, model, opt, batches[2:])
    fabric.strategy.teardown()
    fabric = fabrics(checkpoint_format="full")
    model, opt = fabric.setup(*_model_and_opt())
    state = {"model": model, "optimizer": opt, "step": 0}
    assert fabric.load(tmp_path / "ckpt.pt", state) == {}
    assert state["step"] == 2 and fabric.strategy.engine.step == 2
    assert steps(fabric, model, opt, batches[2:]) == want


def test_storage_options_are_refused_by_the_distributed_format(fabrics, tmp_path: Path) -> None:
    fabric = fabrics(checkpoint_format="distributed")
    fabric.setup(*_model_and_opt())
    model, opt = fabric.strategy.model, fabric.strategy.optimizer  # Fabric's save passes them unwrapped
    with pytest.raises(
        TypeError, match="do not use a CheckpointIO: drop storage_options, or pass checkpoint_format='full'"
    ):
        fabric.strategy.save_checkpoint(tmp_path / "ck", {"model": model, "optimizer": opt}, storage_options={"x": 1})
    assert not (tmp_path / "ck").exists()


# -- two ranks against Fabric DDP, with a bit-exact resume (subprocess jobs) -------------------------------


def run_fabric_job(out: Path, timeout: float = 240, **cfg) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"out": str(out), "steps": STEPS, **cfg}))
    code, output = JobServer.run(out / "config.json", cfg.get("devices", 2), {}, timeout, script=JOB.name)
    assert code == 0, output[-4000:]
    return out


def losses(out: Path, rank: int) -> list[float]:
    return json.loads((out / f"losses_rank{rank}.json").read_text())


def check_against_ddp_and_resume(tmp_path: Path, model: str) -> None:
    ddp = run_fabric_job(tmp_path / "ddp", strategy="ddp", model=model)
    ckpt = str(tmp_path / "ckpt")
    full = run_fabric_job(tmp_path / "slidedp", model=model, save_at=SAVE_AT, ckpt=ckpt)
    resumed = run_fabric_job(tmp_path / "resumed", model=model, resume=ckpt)
    for rank in range(2):
        a, b = losses(full, rank), losses(ddp, rank)
        assert len(a) == len(b) == STEPS
        worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
        assert worst <= RTOL, f"rank {rank}: per-step loss differs from DDP by {worst:.2e} relative"
        assert losses(resumed, rank) == a[SAVE_AT:], f"rank {rank}: the resumed run is not bit-exact"
    got, want, again = (torch.load(d / "final_state.pt") for d in (full, ddp, resumed))
    assert sorted(got) == sorted(want) == sorted(again)
    for k in want:
        assert torch.equal(got[k], again[k]), f"{k}: resumed weights differ"
        rel = weights_rel_err(k, got[k], want[k])
        assert rel <= RTOL, f"{k}: final weights differ from DDP by {rel:.2e} relative"


@pytest.mark.slow  # a subprocess of its own: out of the fast tier
def test_two_ranks_nanogpt_equal_ddp_and_resume_bit_exactly(tmp_path: Path) -> None:
    check_against_ddp_and_resume(tmp_path, "nanogpt")


@pytest.mark.slow
def test_two_ranks_litgpt_equal_ddp_and_resume_bit_exactly(tmp_path: Path) -> None:
    pytest.importorskip("litgpt")
    check_against_ddp_and_resume(tmp_path, "litgpt")
