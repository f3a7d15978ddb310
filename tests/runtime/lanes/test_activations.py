"""runtime.lanes.activations: every checkpointing mode and offload ratio gives bit-identical training, and the
runtime's accounting of retained activation bytes behaves as the policies promise."""

from __future__ import annotations

import pytest
import torch

from slidedp_lightning.runtime.activation_policy import ActivationPolicy, UnitPolicy
from tests.helpers import tiny_model
from tests.runtime.helpers import adamw_groups, loss_of, train


@pytest.fixture(scope="module")
def reference():
    return train(None)


POLICIES = [
    "full",
    "selective",
    "segments:0000000",
    "segments:1111111",
    "segments:1010101",
    "segments:0110010",
    "none@0.5",
    "none@1",
    "full@0.5",
    "full@1",
    "selective@0.5",
    "segments:1010101@0.5",
    "segments:1111111@1",
]


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_trains_bit_identically_to_no_checkpointing(reference, policy):
    losses, state, _ = train(policy)
    ref_losses, ref_state, _ = reference
    assert losses == ref_losses
    for k in ref_state:
        assert torch.equal(state[k], ref_state[k]), f"{k} differs under {policy}"


def test_per_block_overrides_and_untied_head(reference):
    policy = ActivationPolicy(UnitPolicy("full", offload=0.5), {"layers.1": UnitPolicy.parse("segments:0101010@1")})
    losses, state, _ = train(policy, tied=False)
    ref_losses, ref_state, _ = train(None, tied=False)
    assert losses == ref_losses
    assert all(torch.equal(state[k], ref_state[k]) for k in ref_state)


def retained(policy: str) -> tuple[int, int]:
    memory = train(policy, steps=2)[2][-1]
    return memory["retained_activation_bytes"], memory["offloaded_activation_bytes"]


def test_retained_bytes_fall_from_none_to_selective_and_segments_to_full():
    none, selective, seg_all, seg_mixed, full = (
        retained(p)[0] for p in ("none", "selective", "segments:1111111", "segments:0100100", "full")
    )
    assert none > selective > full
    assert none > seg_all > seg_mixed > full
    hidden = 2 * 16 * 64 * 4  # the block input: batch x seq x hidden FP32, per block
    assert full == 2 * hidden, "full checkpointing keeps exactly each block's input"


@pytest.mark.parametrize("mode", ["none", "full", "selective", "segments:1010101"])
@pytest.mark.parametrize("ratio", [0.5, 1.0])
def test_offload_ratio_moves_that_fraction_of_the_retained_bytes_off_the_device(mode, ratio):
    kept0, off0 = retained(mode)
    kept, off = retained(f"{mode}@{ratio}")
    assert off0 == 0
    assert kept + off == kept0, "offloading moves bytes, it neither adds nor drops any"
    assert off / kept0 == pytest.approx(ratio, abs=0.05)


@pytest.mark.parametrize(
    "bad, match",
    [
        ("segments:012", "mask"),
        ("segments", "mask"),
        ("full:0101010", "only 'segments'"),
        ("full@1.5", "offload"),
        ("full@x", "number"),
        ("sometimes", "mode"),
        ("segments:11111111", "mask"),
    ],
)
def test_bad_policies_are_refused_with_a_clear_error(bad, match):
    with pytest.raises(ValueError, match=match):
        UnitPolicy.parse(bad)


def test_policy_round_trips_through_json(tmp_path):
    policy = ActivationPolicy(
        UnitPolicy("selective", offload=0.25), {"layers.0": UnitPolicy.parse("segments:1000001@1")}
    )
    path = tmp_path / "policy.json"
    import json

    path.write_text(json.dumps({"activations": policy.to_dict()}))
    assert ActivationPolicy.coerce(str(path)) == policy
    with pytest.raises(FileNotFoundError):
        ActivationPolicy.coerce(str(tmp_path / "missing.json"))
    with pytest.raises(TypeError):
        ActivationPolicy.coerce(3)


def test_long_sequence_accounting_grows_linearly_with_chunked_loss_and_offload():
    """With full checkpointing, half offloaded and the loss in chunks, the device bytes a step retains are
    proportional to the sequence length (no term in seq^2 or seq x vocab stays on the device)."""
    from slidedp_lightning import use_chunked_loss
    from slidedp_lightning.runtime.engine import EngineConfig, SlideDPEngine
    from tests.helpers import VOCAB
    from tests.runtime.helpers import CPU

    retained = {}
    for seq in (8, 16, 32):
        model = tiny_model(True)
        use_chunked_loss(model, 8)
        config = EngineConfig(activation_policy=ActivationPolicy.coerce("full@0.5"))
        engine = SlideDPEngine(model, config, device=CPU, compute_dtype=torch.float32)
        try:
            engine.attach_optimizer(adamw_groups(model))
            x = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(seq))
            loss_of(model, x).backward()
            assert engine.end_step()
            memory = engine.device_memory()
            retained[seq] = (memory["retained_activation_bytes"], memory["offloaded_activation_bytes"])
        finally:
            engine.close()
    assert retained[16] == tuple(2 * b for b in retained[8]) and retained[32] == tuple(4 * b for b in retained[8])
    assert retained[8][0] == retained[8][1] > 0


@pytest.mark.parametrize("form", ["indexed", "list"])
def test_selective_store_keeps_torch_entries_in_either_form(form):
    """Selective checkpointing's cache in both of torch's access forms (``store[op][i] = e`` / ``.get(i)``, and
    the list form of releases before 2.13: ``.append(e)`` / ``.pop(0)``): saved outputs are retained (half of
    each offloaded here) and come back equal, in call order."""
    from torch import nn
    from torch.utils.checkpoint import _VersionWrapper

    from slidedp_lightning.runtime.compat import SelectiveCacheStore
    from slidedp_lightning.runtime.lanes.activations import ActivationManager, _Retained
    from slidedp_lightning.runtime.lanes.streams import make_lanes

    lanes = make_lanes(torch.device("cpu"))
    manager = ActivationManager(
        blocks={0: nn.Identity()},
        names=["layers.0"],
        policy=ActivationPolicy(UnitPolicy.parse("selective@0.5")),
        lanes=lanes,
        param_storages=lambda: [],
    )
    outputs = [torch.randn(4, 8) for _ in range(3)]
    store = SelectiveCacheStore(manager._stash, manager._get)  # what the selective mode installs
    op = torch.ops.aten.mm.default
    try:
        manager._unit = 0
        for i, t in enumerate(outputs):
            entry = (_VersionWrapper(t.clone()),)
            if form == "list":
                store[op].append(entry)
            else:
                store[op][i] = entry
        manager._unit = None
        assert all(isinstance(e[0].val.handle, _Retained) for e in store[op].values()), "stored outputs are retained"
        assert sum(manager.offloaded_bytes.values()) == sum(t.numel() * t.element_size() for t in outputs) // 2
        if form == "list":
            back = [store[op].pop(0) for _ in outputs]
            assert len(store[op]) == 0
        else:
            back = [store[op].get(i) for i in range(len(outputs))]
        for (w,), t in zip(back, outputs):
            assert torch.equal(w.get_val(False), t)
    finally:
        lanes.close()
