"""WeightSource: safetensors read tensor by tensor into flat FP32 views; the ledger filled from it by every rank,
each its share (host-sharded: only this host's ranges), with errors agreed over the job."""

from __future__ import annotations

import glob
import json
import os
import socket
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from slidedp_lightning.models import adapter_for
from slidedp_lightning.runtime.config import EngineConfig
from slidedp_lightning.runtime.layout import build_layout
from slidedp_lightning.runtime.ledger import weight_source as weights_mod
from slidedp_lightning.runtime.ledger.host_ledger import HostLedger
from slidedp_lightning.runtime.ledger.initial_weights import InitialWeights, balanced_shares
from slidedp_lightning.runtime.ledger.opening import ledger_geometry
from slidedp_lightning.runtime.ledger.weight_source import (
    WEIGHT_SOURCE_ATTR,
    CheckpointError,
    SafetensorsWeights,
    WeightSource,
    scan_safetensors,
)
from slidedp_lightning.runtime.topology import Topology


def tiny_config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )


def write_checkpoint(directory: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """An untied tiny Qwen3 in BF16, saved in several shards; returns its weights in FP32."""
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_config()).to(torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="60KB")
    return {k: v.float() for k, v in model.state_dict().items()}


def source_for(directory: Path) -> SafetensorsWeights:
    """The checkpoint's tensors under their own keys (an untied model's parameter names)."""
    stored = scan_safetensors(str(directory))
    return SafetensorsWeights(stored, f"checkpoint {directory}")


def meta_model(directory: Path) -> Qwen3ForCausalLM:
    with torch.device("meta"):
        model = Qwen3ForCausalLM(tiny_config())
    setattr(model, WEIGHT_SOURCE_ATTR, source_for(directory))
    return model


# -- reading -----------------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _special(values: torch.Tensor) -> torch.Tensor:
    """``values`` with NaNs (several payloads), infinities, subnormals and signed zeros written over its start."""
    bits = [0x7FC0, 0xFFC0, 0x7F81, 0xFFFF, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x8000, 0x0000]
    out = values.clone().reshape(-1)
    out[: len(bits)] = torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(out.dtype)
    return out.reshape(values.shape)


@pytest.mark.parametrize("path", ["mapped", "sliced"])
def test_any_element_range_reads_as_the_fp32_conversion_of_the_stored_tensor(tmp_path, monkeypatch, path) -> None:
    monkeypatch.setattr(weights_mod, "BLOCK_ELEMS", 40)  # several blocks per tensor, rows cut at both ends
    if path == "sliced":  # safe_open slices converted by torch, the path for what cannot be mapped
        monkeypatch.setattr(SafetensorsWeights, "_mapped", lambda self, t: None)
    else:  # every tensor read from the mapped file: the slicing path must not be taken
        monkeypatch.setattr(SafetensorsWeights, "_read_sliced", lambda *a: pytest.fail("read through safe_open"))
    g = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": _special(torch.randn(13, 7, generator=g).bfloat16()),
        "fp16": torch.randn(5, 3, 4, generator=g).half(),
        "fp32": _special(torch.randn(101, generator=g)),
        "fp64": torch.randn(3, 50, generator=g).double(),
        "scalar": torch.tensor(1.5, dtype=torch.bfloat16),
        "wide": torch.randn(2, 97, generator=g).bfloat16(),  # a row longer than a block
    }
    save_file({k: tensors[k] for k in ("bf16", "fp16", "scalar")}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in ("fp32", "fp64", "wide")}, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {k: f"model-0000{1 if k in ('bf16', 'fp16', 'scalar') else 2}-of-00002.safetensors" for k in tensors}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    source = source_for(tmp_path)
    assert isinstance(source, WeightSource) and source.names() == set(tensors)
    for name, t in tensors.items():
        flat = t.to(torch.float32).reshape(-1)
        assert source.shape(name) == tuple(t.shape) and source.nbytes(name) == t.numel() * t.element_size()
        ranges = [(0, flat.numel())] + [
            (s, n) for s in range(0, flat.numel(), 11) for n in (1, 17) if s + n <= flat.numel()
        ]
        for start, count in ranges:
            out = torch.full((count,), 7.0)
            source.read_into(name, out, start)
            assert torch.equal(_bits(out), _bits(flat[start : start + count])), (name, start, count)  # NaNs too
            both = torch.full((count,), 7.0), torch.full((count,), 7.0, dtype=torch.bfloat16)
            source.read_into(name, *both[:1], start, both[1])
            converted = torch.empty(count, dtype=torch.bfloat16).copy_(out)  # what the ledger's refresh writes
            assert torch.equal(_bits(both[0]), _bits(out)), (name, start, count)
            assert torch.equal(_bits(both[1]), _bits(converted)), (name, start, count)
    with pytest.raises(CheckpointError, match="outside 'fp32'"):
        source.read_into("fp32", torch.empty(5), 100)
    source.close()


def test_a_tensor_stored_twice_or_an_index_naming_the_wrong_file_is_refused(tmp_path) -> None:
    save_file({"a": torch.zeros(2)}, str(tmp_path / "one.safetensors"))
    save_file({"a": torch.zeros(2), "b": torch.zeros(1)}, str(tmp_path / "two.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "one.safetensors", "b": "two.safetensors"}}))
    with pytest.raises(CheckpointError, match="'a' is stored twice"):
        scan_safetensors(str(tmp_path))
    save_file({"b": torch.zeros(1)}, str(tmp_path / "two.safetensors"))
    index.write_text(json.dumps({"weight_map": {"a": "two.safetensors", "b": "one.safetensors"}}))
    with pytest.raises(CheckpointError, match="places 2 tensor.*'a' in .*two.safetensors.*it is in .*one"):
        scan_safetensors(str(tmp_path))


def test_balanced_shares_split_every_unit_once_and_evenly() -> None:
    sizes = [50, 10, 10, 10, 10, 30, 30, 5]
    for count in (1, 2, 3):
        shares = balanced_shares(sizes, count)
        assert sorted(i for s in shares for i in s) == list(range(len(sizes)))
        loads = [sum(sizes[i] for i in s) for s in shares]
        assert max(loads) - min(loads) <= max(sizes)
    assert balanced_shares(sizes, 2) == balanced_shares(list(sizes), 2)  # the same on every rank


# -- filling the ledger ------------------------------------------------------------------------------------


def _expected_flat(layout, expected: dict[str, torch.Tensor]) -> torch.Tensor:
    flat = torch.zeros(layout.total)
    for unit in layout.units:
        for slot in unit.slots:
            start = unit.offset + slot.offset
            flat[start : start + slot.numel] = expected[slot.name].reshape(-1)
    return flat


def _ledger(tmp_path: Path, layout, topology: Topology) -> HostLedger:
    geometry = ledger_geometry(layout, EngineConfig(), topology, torch.float32)
    return HostLedger(str(tmp_path), geometry, create=True)


def test_each_local_rank_fills_its_share_and_a_host_sharded_ledger_only_its_ranges(tmp_path) -> None:
    expected = write_checkpoint(tmp_path / "ckpt")
    topologies = [  # host 1 of 2, host-sharded: global ranks 2 and 3
        Topology(global_rank=2 + r, local_rank=r, ranks_per_host=2, hosts=2, host=1, host_layout="sharded")
        for r in range(2)
    ]
    model = meta_model(tmp_path / "ckpt")
    adapter = adapter_for(model)
    layout = build_layout(model, adapter.units(model), topologies[0].shard_world, topologies[0].owners)
    ledger = _ledger(tmp_path, layout, topologies[0])
    try:
        fills = [InitialWeights(model, adapter, layout, t) for t in topologies]
        assert all(f.from_source for f in fills)
        ranges = fills[0].host_ranges()
        assert ranges is not None
        inside = torch.zeros(layout.total, dtype=torch.bool)
        for a, b in ranges:
            inside[a:b] = True
        want = torch.where(inside, _expected_flat(layout, expected), 0.0)
        fills[0].load(ledger)  # local rank 0 alone: its units only
        written = torch.zeros(layout.total, dtype=torch.bool)
        for u in balanced_shares([b - a for a, b in ranges], 2)[0]:
            written[ranges[u][0] : ranges[u][1]] = True
        assert torch.equal(ledger.master, torch.where(written, want, 0.0))
        assert 0 < int(written.sum()) < int(inside.sum())
        fills[1].load(ledger)
        assert torch.equal(ledger.master, want)
        assert torch.equal(ledger.bf16, want.to(torch.bfloat16))  # BF16 copy of this host's ranges only
        assert all(f.report is not None and f.report.kind == "checkpoint" for f in fills)
    finally:
        ledger.close()


def test_a_source_that_lacks_a_parameter_or_holds_another_shape_fails_before_any_ledger(tmp_path) -> None:
    write_checkpoint(tmp_path / "ckpt")
    model = meta_model(tmp_path / "ckpt")
    stored = scan_safetensors(str(tmp_path / "ckpt"))
    del stored["model.norm.weight"]
    stored["lm_head.weight"] = replace(stored["lm_head.weight"], shape=(3, 3))
    setattr(model, WEIGHT_SOURCE_ATTR, SafetensorsWeights(stored, "broken"))
    adapter = adapter_for(model)
    layout = build_layout(model, adapter.units(model), 1)
    with pytest.raises(
        CheckpointError, match=r"missing 1 parameter.*model\.norm\.weight.*lm_head\.weight: stored \[3, 3\]"
    ):
        InitialWeights(model, adapter, layout, Topology())


def test_materialized_parameters_win_over_the_source(tmp_path) -> None:
    """A model given back its weights by an earlier run keeps them: the source is not read again."""
    write_checkpoint(tmp_path / "ckpt")
    torch.manual_seed(5)
    model = Qwen3ForCausalLM(tiny_config())
    setattr(model, WEIGHT_SOURCE_ATTR, source_for(tmp_path / "ckpt"))
    adapter = adapter_for(model)
    assert not InitialWeights(model, adapter, build_layout(model, adapter.units(model), 1), Topology()).from_source


# -- two ranks -----------------------------------------------------------------------------------------------


def _two_ranks(rank: int, port: int, directory: str, out: str) -> None:
    import torch.distributed as dist

    from slidedp_lightning.runtime.engine import SlideDPEngine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    read: list[str] = []
    original = SafetensorsWeights.read_into

    def recording(self, name, out_, start=0, bf16=None):
        read.append(name)
        if os.environ.get("SLIDEDP_TEST_FAIL_RANK") == str(rank):
            raise OSError(f"disk gone under {name}")
        return original(self, name, out_, start, bf16)

    SafetensorsWeights.read_into = recording  # type: ignore[method-assign]
    results: dict = {"pid": os.getpid()}
    try:
        for case, replicated in (("shared", False), ("replicated", True)):
            read.clear()
            topology = Topology.build(global_rank=rank, local_rank=rank, ranks_per_host=2, ledger_per_rank=replicated)
            config = EngineConfig(param_route="replicated" if replicated else "full")
            engine = SlideDPEngine(
                meta_model(Path(directory)),
                config,
                device=torch.device("cpu"),
                compute_dtype=torch.float32,
                topology=topology,
            )
            results[case] = {"state": engine.state_dict(), "read": sorted(set(read))}
            engine.close(restore=False)
        os.environ["SLIDEDP_TEST_FAIL_RANK"] = "1"
        try:
            SlideDPEngine(
                meta_model(Path(directory)),
                EngineConfig(),
                device=torch.device("cpu"),
                compute_dtype=torch.float32,
                topology=Topology.build(global_rank=rank, local_rank=rank, ranks_per_host=2),
            )
            results["error"] = None
        except Exception as err:
            results["error"] = f"{type(err).__name__}: {err}"
        dist.barrier()
        results["ledgers_left"] = sorted(glob.glob("/dev/shm/slidedp-*"))
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # spawns a process group
def test_two_ranks_split_the_read_agree_on_errors_and_leave_no_ledger(tmp_path) -> None:
    import torch.multiprocessing as mp

    expected = write_checkpoint(tmp_path / "ckpt")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_two_ranks, args=(port, str(tmp_path / "ckpt"), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    names = set(expected)
    shared = [set(r["shared"]["read"]) for r in ranks]
    assert shared[0] and shared[1] and not shared[0] & shared[1] and shared[0] | shared[1] == names
    assert all(set(r["replicated"]["read"]) == names for r in ranks)  # a private ledger each: every rank reads all
    for r in ranks:
        for case in ("shared", "replicated"):
            state = r[case]["state"]
            assert all(torch.equal(state[n], expected[n]) for n in names), case
    assert ranks[1]["error"].startswith("OSError: disk gone under")
    assert (
        ranks[0]["error"].startswith("CheckpointError: rank 1 could not read the checkpoint")
        and "disk gone" in ranks[0]["error"]
    )
    pids = [str(r["pid"]) for r in ranks]
    leaked = [p for r in ranks for p in r["ledgers_left"] if any(f"-{pid}-" in os.path.basename(p) for pid in pids)]
    assert not leaked
