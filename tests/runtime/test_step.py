"""StepDriver on a tiny Qwen3, one process, CPU: gradients that cannot be applied, one backward per step,
unit residency and prefetch around the hooks, backpressure from the update lane, loads between steps."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import threading

import pytest
import torch

from slidedp_lightning.runtime.engine import EngineConfig, SlideDPEngine
from tests.helpers import (
    rel_err,
    tiny_model,
)
from tests.runtime.helpers import CPU, adamw_groups, assert_rel_close, batches, loss_of, train_pair

# -- (e): gradients that cannot be applied ------------------------------------------------------------------


def test_parameters_without_gradient_raise(engines) -> None:
    model = tiny_model(tied=False)
    engine = engines(model)
    engine.attach_optimizer(adamw_groups(model))
    x = batches(1)[0]
    with pytest.raises(RuntimeError, match="received no gradient") as info:
        model.model.embed_tokens(x).sum().backward()
    assert "model.layers.0." in str(info.value)


def _backward_twice_two_forwards(model, x):
    a, b = loss_of(model, x), loss_of(model, x)
    a.backward()
    b.backward()


def _backward_forward_backward(model, x):
    loss_of(model, x).backward()
    loss_of(model, x).backward()


SECOND_BACKWARD = {
    "two-forwards": _backward_twice_two_forwards,
    "forward-backward-twice": _backward_forward_backward,
}

# run in a child process: on the tied model the second backward can crash the interpreter (SIGSEGV)
_SECOND_BACKWARD_CHILD = """
import sys
from tests.runtime.test_step import SECOND_BACKWARD
from tests.helpers import tiny_model
from tests.runtime.helpers import adamw_groups, batches, make_engine
model = tiny_model(sys.argv[2] == "tied")
engine = make_engine(model)
engine.attach_optimizer(adamw_groups(model))
try:
    SECOND_BACKWARD[sys.argv[1]](model, batches(1)[0])
except RuntimeError as exc:
    print("RuntimeError:", exc)
    sys.exit(3)
print("no error")
"""


@pytest.mark.slow  # a fresh interpreter per case
@pytest.mark.parametrize("scenario, tied", [("forward-backward-twice", "tied"), ("two-forwards", "untied")])
def test_second_backward_before_end_step_raises(scenario: str, tied: str) -> None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _SECOND_BACKWARD_CHILD, scenario, tied],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr[-2000:]
    assert proc.returncode == 3, f"exit status {proc.returncode} (negative: killed by a signal):\n{out}"
    assert "second gradient" in proc.stdout, out


def test_end_step_without_backward_is_no_step(engines) -> None:
    model = tiny_model()
    engine = engines(model)
    engine.attach_optimizer(adamw_groups(model))
    before = engine.state_dict()
    with torch.no_grad():
        loss_of(model, batches(1)[0])
    assert engine.end_step() is False
    assert engine.step == 0
    assert_rel_close(engine.state_dict(), before, tol=0.0)


# -- (h): residency -----------------------------------------------------------------------------------------
# these follow the device copies of units (a CPU device computes on the ledger itself unless unit_copies="always")
COPIES = "always"


def device_bytes(res) -> int:
    """What the unit buffers really hold right now (a non-resident unit's storage has size 0)."""
    return sum(b.untyped_storage().nbytes() for b in res.buffers)


def sample_after_acquire(res) -> list[int]:
    """Record the device footprint after every acquire, once its prefetches have landed.

    Memory only grows in the H2D fills that ``acquire`` starts, so these samples include every local maximum;
    waiting for the in-flight fills (without finishing them) makes the samples independent of thread timing.
    """
    peak = [0]
    acquire = res.acquire

    def sampled(units, step, backward):
        acquire(units, step, backward)
        for fut in list(res.pending.values()):
            fut.result()
        peak[0] = max(peak[0], device_bytes(res))

    res.acquire = sampled
    return peak


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("window", [1, 2, 3])
def test_residency_after_step_and_peak(engines, window: int, tied: bool) -> None:
    model = tiny_model(tied)
    engine = engines(model, prefetch_window=window, unit_copies=COPIES)
    engine.attach_optimizer(adamw_groups(model))
    res = engine.residency
    unit_bytes = [u.padded * 4 for u in engine.layout.units]
    assert not any(res.resident) and res.peak_resident_bytes == 0
    assert device_bytes(res) == 0, "bound units cost no device memory"

    for x in batches(2):
        loss_of(model, x).backward()
        assert engine.end_step()
        assert res.resident == [False] * len(unit_bytes)
        assert not res.pending and res.resident_bytes == 0
        assert not any(res.refs) and not any(res.held_for_backward)
        assert device_bytes(res) == 0

    layer = max(unit_bytes[1:-1])
    if tied:
        # the tied lm_head's backward holds the embedding unit until the embedding's own backward: the embedding
        # stays resident through the whole backward, next to one block at a time
        assert res.peak_resident_bytes == unit_bytes[0] + layer
    else:
        # untied: one unit at a time (a unit is released as soon as its last gradient lands)
        assert res.peak_resident_bytes == max(unit_bytes)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("window", [1, 2, 3])
def test_prefetch_stays_within_window(engines, tied: bool, window: int) -> None:
    """The device holds the acquired units (peak_resident_bytes) plus at most window-1 prefetched units.

    (Regression: a tied lm_head, whose only unit is the embedding, used to prefetch layers.0 at the end of forward.)
    """
    model = tiny_model(tied)
    engine = engines(model, prefetch_window=window, unit_copies=COPIES)
    engine.attach_optimizer(adamw_groups(model))
    res = engine.residency
    physical_peak = sample_after_acquire(res)
    for x in batches(2):
        loss_of(model, x).backward()
        assert engine.end_step()
    max_unit = max(u.padded * 4 for u in engine.layout.units)
    if window == 1:
        assert physical_peak[0] == res.peak_resident_bytes
    else:
        assert physical_peak[0] > res.peak_resident_bytes, "the prefetch window really fills ahead"
    assert physical_peak[0] <= res.peak_resident_bytes + (window - 1) * max_unit


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("window", [1, 2, 3])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_forward_leaves_nothing_in_flight(engines, tied: bool, window: int, grad: bool) -> None:
    """After a whole forward nothing is being filled and at most the unit the forward used last stays on the
    device (backward starts there); in particular no prefetch of layers.0 wraps around from a tied lm_head."""
    model = tiny_model(tied)
    engine = engines(model, prefetch_window=window, unit_copies=COPIES)
    engine.attach_optimizer(adamw_groups(model))
    res = engine.residency
    with torch.set_grad_enabled(grad):
        loss = loss_of(model, batches(1)[0])
    for fut in list(res.pending.values()):
        fut.result()
    in_flight = sorted(res.pending)
    filled = [engine.layout.units[u].name for u, b in enumerate(res.buffers) if b.untyped_storage().nbytes()]
    resident = [engine.layout.units[u].name for u, r in enumerate(res.resident) if r]
    if grad:
        loss.backward()
        assert engine.end_step()
        assert not any(res.resident) and device_bytes(res) == 0
    last = "embed" if tied else "head"  # the unit of lm_head
    assert in_flight == []
    assert set(filled) <= {last}, f"left on the device after forward: {filled}"
    assert filled == resident


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_forward_before_end_step_does_not_leave_stale_weights(engines, tied: bool) -> None:
    model = tiny_model(tied)
    ref = copy.deepcopy(model)
    # every unit's update may wait behind the gate (backpressure would otherwise hold backward until it opens)
    engine = engines(model, max_units_in_flight=16)
    engine.attach_optimizer(adamw_groups(model))
    ref_opt = adamw_groups(ref)
    x, y = batches(2)
    gate = threading.Event()  # hold the CPU updates until the no-grad forward has read the ledger
    apply = engine.lane._apply

    def gated(task):
        gate.wait(timeout=60)
        apply(task)

    engine.lane._apply = gated
    loss_of(model, x).backward()
    with torch.no_grad():
        before_step = model(input_ids=y).logits  # the optimizer step has not happened yet: old weights
    gate.set()
    assert engine.end_step()
    engine.synchronize()
    with torch.no_grad():
        after_step = model(input_ids=y).logits

    ref_opt.zero_grad()
    loss_of(ref, x).backward()
    with torch.no_grad():
        ref_before = ref(input_ids=y).logits
    ref_opt.step()
    with torch.no_grad():
        ref_after = ref(input_ids=y).logits
    assert rel_err(before_step, ref_before) <= 1e-5
    assert rel_err(after_step, ref_after) <= 1e-5, "the forward after end_step used stale weights"


# -- backpressure and loads between steps --------------------------------------------------------------


def test_backward_waits_for_the_update_lane_beyond_max_units_in_flight(engines, monkeypatch) -> None:
    """Backpressure: however slow the CPU update, at most max_units_in_flight units' gradients wait for it."""
    from slidedp_lightning.runtime.lanes import liveness as sync
    from slidedp_lightning.runtime.lanes import update

    model = tiny_model(tied=False)
    ref = copy.deepcopy(model)
    engine = engines(model, max_units_in_flight=1)
    opt, ref_opt = adamw_groups(model), adamw_groups(ref)
    engine.attach_optimizer(opt)
    seen, apply = [], update.UpdateLane._apply

    def slow_apply(lane, task):
        seen.append(lane._units_in_flight)
        sync.time.sleep(0.01)
        apply(lane, task)

    monkeypatch.setattr(update.UpdateLane, "_apply", slow_apply)
    losses, ref_losses = train_pair(model, engine, ref, opt, ref_opt, steps=3)
    assert seen and max(seen) <= 1
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ref_losses))


@pytest.mark.parametrize("window", [1, 3])
def test_load_state_dict_between_steps_is_what_the_next_forward_sees(window: int) -> None:
    """Weights loaded after a forward (units resident as BF16 copies, the last one parked) are the ones the next
    forward computes with: nothing filled before the load survives it."""
    model = tiny_model(tied=False)
    engine = SlideDPEngine(model, EngineConfig(prefetch_window=window), device=CPU, compute_dtype=torch.bfloat16)
    try:
        engine.attach_optimizer(adamw_groups(model))
        for x in batches(3):
            loss_of(model, x).backward()
            assert engine.end_step()
        other = tiny_model(tied=False, seed=5)
        x = batches(1, seed=9)[0]
        with torch.no_grad():
            loss_of(model, x)  # units filled with the trained weights; the last one stays parked
        engine.load_state_dict(other.state_dict())
        for p in other.parameters():
            p.data = p.data.to(torch.bfloat16)
        with torch.no_grad():
            assert loss_of(model, x).item() == loss_of(other, x).item()
    finally:
        engine.close()
