"""The step graph of a CPU "device": which units it copies before computing on them, as the runtime's residency."""

from __future__ import annotations

from dataclasses import replace

import pytest

from slidedp_lightning.constants import IN_LEDGER_MIN_BYTES
from slidedp_lightning.steptime import StepConfig, load_config, simulate
from slidedp_lightning.steptime.ops import build_ops
from tests.steptime.test_multinode import _machine

# Qwen3 shapes with one small block and a large untied vocabulary: the embedding and the head are 33.6 MB in FP32
# (at least IN_LEDGER_MIN_BYTES), 16.8 MB in BF16; the block is small
WIDE = dict(vocab_size=32768, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)  # fmt: skip


def _copied(cfg: StepConfig) -> list[bool]:
    """Per unit: whether its forward fetch copies bytes."""
    ops = [op for op in build_ops(cfg, _machine(), steps=1) if op.name == "h2d fwd"]
    return [any(v > 0 for v in op.demand.values()) for op in sorted(ops, key=lambda op: op.unit)]


def test_a_cpu_device_computes_its_large_units_in_the_ledger():
    """Route full: a unit whose ledger source is in the compute dtype (the master under 32-true, the BF16 copy under
    bf16-mixed) and holds at least IN_LEDGER_MIN_BYTES is not copied (unit_copies "auto"); every one the dtype
    allows with "never", none with "always"; the sharded route copies and gathers every unit."""
    shape = load_config(WIDE)
    assert shape.vocab * shape.hidden * 4 >= IN_LEDGER_MIN_BYTES > shape.vocab * shape.hidden * 2
    base = StepConfig(shape, 1, 26, 2, "full", precision="32-true")
    assert _copied(base) == [False, True, False]  # embedding, block, head
    assert _copied(replace(base, unit_copies="never")) == [False, False, False]
    assert _copied(replace(base, unit_copies="always")) == [True, True, True]
    assert _copied(replace(base, precision="bf16-mixed")) == [True, True, True]  # 16.8 MB in BF16
    assert _copied(replace(base, precision="bf16-mixed", unit_copies="never")) == [False, False, False]
    assert _copied(replace(base, precision="bf16-mixed", bf16_copy=False, unit_copies="never")) == [True] * 3
    assert _copied(replace(base, param_route="sharded")) == [True, True, True]
    # no copy, no copy time: the step is shorter by the bytes not copied
    assert (
        simulate(base, _machine()).busy["h2d"] < simulate(replace(base, unit_copies="always"), _machine()).busy["h2d"]
    )
    with pytest.raises(ValueError, match="unit_copies"):
        replace(base, unit_copies="sometimes")


def test_on_a_cpu_device_the_replicated_all_reduce_costs_what_gpu_reduce_does():
    """On a CPU "device" gpu_reduce is gloo's in-place all-reduce of the whole unit, the form calibrate times, so the
    replicated layout's all-reduce moves the same link bytes; with device collectives (NCCL) it moves twice a
    reduce-scatter's."""

    def link_bytes(profile, param_route: str) -> list[float]:
        cfg = StepConfig(load_config(WIDE), 1, 26, 2, param_route, precision="32-true")
        return [op.demand.get("link", 0.0) for op in build_ops(cfg, profile, steps=1) if op.lane == "reduce"]

    cpu = _machine()
    assert link_bytes(cpu, "replicated") == pytest.approx(link_bytes(cpu, "full"))
    gpu = replace(cpu, values={**cpu.values, "host_is_device": False})
    assert link_bytes(gpu, "replicated") == pytest.approx([2 * b for b in link_bytes(gpu, "full")])
    assert all(b > 0 for b in link_bytes(gpu, "full"))
