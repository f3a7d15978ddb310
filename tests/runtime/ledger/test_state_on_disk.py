"""The Adam moments in a state file on a local disk (``EngineConfig.state_dir``), one process, CPU: the same bits as
the ledger in host memory for every knob of the update, and a ledger in memory smaller by the moments."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import pytest
import torch
from transformers import Qwen3ForCausalLM

from slidedp_lightning.checkpoints import distributed as checkpoint
from slidedp_lightning.options import SlideDPOptions, StateOnDisk
from slidedp_lightning.runtime.engine import EngineConfig, SlideDPEngine
from slidedp_lightning.runtime.ledger import disk
from slidedp_lightning.runtime.ledger.state import UnsupportedLayoutError
from tests.helpers import tiny_config, tiny_model, token_batches

CPU = torch.device("cpu")


def run(
    config: EngineConfig,
    dtype: torch.dtype = torch.float32,
    steps: int = 5,
    inspect=None,
    save: Path | None = None,
    load: Path | None = None,
):
    """``steps`` steps of a tiny model (a checkpoint saved to ``save`` after half of them; or from ``load``, which
    holds that half, the rest); returns (losses, state dict, ledger stats, (bytes read and written on disk, most records of a shard))."""
    model = tiny_model(False, layers=3, seed=5 if load else 0)
    engine = SlideDPEngine(model, config, device=CPU, compute_dtype=dtype)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
        engine.attach_optimizer(opt)
        losses = []
        batches = token_batches(steps * config.accumulate, 2, 16)
        if load is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # DCP without a process group
                checkpoint.load(engine, load)
            batches = batches[len(batches) // 2 :]
        for i, x in enumerate(batches):
            if save is not None and i == len(batches) // 2:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    checkpoint.save(engine, {"state_dict": {}}, save)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            if (i + 1) % config.accumulate == 0:
                assert engine.end_step()
            losses.append(loss.item())
        engine.synchronize()
        io = (0, 0, 0)
        if engine.ledger.disk is not None:
            stream = engine.ledger.disk.stream(engine.topology.owner_rank)
            most = max(len(engine.ledger.disk.layout.pieces(u, 0)) for u in range(len(engine.layout.units)))
            io = (stream.read_bytes, stream.written_bytes, most)
        if inspect is not None:
            inspect(engine, opt)
        return losses, engine.state_dict(), engine.ledger_stats(), io
    finally:
        engine.close(restore=False)


def _assert_same(got, ref) -> None:
    assert got[0] == ref[0], "losses differ"
    assert got[1].keys() == ref[1].keys()
    for k in ref[1]:
        assert torch.equal(got[1][k], ref[1][k]), k


KNOBS = [
    {},
    {"grad_route": "host_reduce"},
    {"chunk_bytes": 4096},
    {"update": "deferred"},
    {"accumulate": 2},
    {"param_route": "sharded", "prefetch_window": 1},
    {"optimizer_state": "int8"},
    {"optimizer_state": "int8", "chunk_bytes": 4096, "update": "deferred"},
]


@pytest.mark.parametrize("pieces", ["whole", "16KiB"])
@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()) or "default")
def test_moments_on_disk_train_bit_identically(tmp_path: Path, knobs: dict, pieces: str, monkeypatch) -> None:
    """Each shard in one record, or in records of 16 KiB (2048 FP32 moment pairs, 2 blocks: the units' shards in
    several, updated and written back record by record, also across the chunks of a unit)."""
    if pieces != "whole":
        monkeypatch.setattr(disk, "PIECE_BYTES", 16 << 10)
    ref = run(EngineConfig(**knobs))
    got = run(EngineConfig(state_dir=str(tmp_path), **knobs))
    _assert_same(got, ref)
    read, written, most = got[3]
    assert read > 0 and written > 0, "the update read and wrote its moments through the state file"
    assert (most > 2) == (pieces != "whole"), most
    assert os.listdir(tmp_path) == [], "the state file is unnamed: nothing is left in the directory"


def test_bf16_compute_with_moments_on_disk_is_bit_identical(tmp_path: Path) -> None:
    _assert_same(run(EngineConfig(state_dir=str(tmp_path)), torch.bfloat16), run(EngineConfig(), torch.bfloat16))


@pytest.mark.parametrize("state", ["fp32", "int8"])
def test_the_ledger_in_memory_holds_no_moments(tmp_path: Path, state: str) -> None:
    ram = run(EngineConfig(optimizer_state=state), steps=1)[2]
    disk = run(EngineConfig(optimizer_state=state, state_dir=str(tmp_path)), steps=1)[2]
    per_param = 8 if state == "fp32" else 2 + 8 / 1024
    saved = ram.nbytes - disk.nbytes
    assert per_param * ram.padded_params <= saved <= per_param * ram.padded_params + 3 * 4096 * 2, (saved, ram)


def test_reading_moments_on_disk_is_refused_with_what_to_do(tmp_path: Path) -> None:
    def inspect(engine, opt):
        with pytest.raises(UnsupportedLayoutError, match="state file on disk"):
            engine.optimizer_state_dict(opt)
        assert engine.state_dict()  # the weights are in memory: they export as usual

    run(EngineConfig(state_dir=str(tmp_path)), steps=1, inspect=inspect)


def test_a_state_directory_that_does_not_exist_is_refused_before_any_state(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="does not exist"):
        SlideDPEngine(
            tiny_model(False), EngineConfig(state_dir=str(tmp_path / "absent")), device=CPU, compute_dtype=torch.float32
        )


def test_replicated_ledgers_refuse_a_state_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="one file per host"):
        EngineConfig(state_dir=str(tmp_path), param_route="replicated")


@pytest.mark.parametrize("moments", ["fp32", "int8"])
@pytest.mark.parametrize("where", ["disk-disk", "disk-memory", "memory-disk"])
def test_a_checkpoint_resumes_bit_exact_wherever_the_moments_live(tmp_path: Path, moments: str, where: str) -> None:
    """Saved with the moments on disk or in memory, resumed with them on disk or in memory: the same checkpoint
    format, the same bits as the run that was not interrupted."""
    state = tmp_path / "state"
    state.mkdir()
    saves, loads = where.split("-")
    config = {place: EngineConfig(optimizer_state=moments, state_dir=str(state) if place == "disk" else None)
              for place in ("disk", "memory")}  # fmt: skip
    straight = run(config[saves], steps=6, save=tmp_path / "ck")
    resumed = run(config[loads], steps=6, load=tmp_path / "ck")
    assert resumed[0] == straight[0][3:]
    assert all(torch.equal(resumed[1][k], straight[1][k]) for k in straight[1])
    assert os.listdir(state) == []


def test_the_strategy_option_sets_the_engine_config(tmp_path: Path) -> None:
    options = SlideDPOptions(optimizer_state=StateOnDisk(str(tmp_path), moments="int8"))
    config = options.base_engine_config()
    assert config.optimizer_state == "int8" and config.state_dir == str(tmp_path)
    assert SlideDPOptions().base_engine_config().state_dir is None
    with pytest.raises(ValueError, match="checkpoint_format='distributed'"):
        SlideDPOptions(optimizer_state=StateOnDisk(str(tmp_path)), checkpoint_format="full")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        StateOnDisk(str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="moments must be one of"):
        StateOnDisk(str(tmp_path), moments="fp16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one file per host"):
        SlideDPOptions(optimizer_state=StateOnDisk(str(tmp_path)), param_route="replicated")


def test_an_io_error_in_a_step_stops_training_naming_the_state_directory(tmp_path: Path, monkeypatch) -> None:
    """A write of the state file that fails (EIO) fails training (at the latest when the record is read again or
    the state is flushed), with the directory, the operation and the size in the error."""
    import errno

    from slidedp_lightning.runtime.ledger import disk

    writes = {"n": 0}
    real = disk.StateFile.write_from

    def failing(self, offset, buf):
        writes["n"] += 1
        if writes["n"] == 12:  # past the setup's clearing pass (none for FP32 moments): a write of step 2 or 3
            raise self._error("write", offset, buf.nbytes, OSError(errno.EIO, "Input/output error"))
        return real(self, offset, buf)

    monkeypatch.setattr(disk.StateFile, "write_from", failing)
    model = tiny_model(False, layers=3)
    engine = SlideDPEngine(model, EngineConfig(state_dir=str(tmp_path)), device=CPU, compute_dtype=torch.float32)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        engine.attach_optimizer(opt)
        with pytest.raises(RuntimeError, match="CPU update failed") as caught:
            for x in token_batches(8, 2, 16):
                model(input_ids=x, labels=x).loss.backward()
                engine.end_step()
            engine.synchronize()
        chain, err = [], caught.value
        while err is not None:
            chain.append(str(err))
            err = err.__cause__
        assert any(str(tmp_path) in m and "write of" in m and "Input/output error" in m for m in chain), chain
    finally:
        engine.abort()
        engine.close(restore=False)


def test_the_state_files_io_is_traced_on_the_disk_lane(tmp_path: Path) -> None:
    def inspect(engine, opt):
        disk_spans = [s for s in engine.tracer.spans if s.lane == "disk"]
        assert {s.name for s in disk_spans} == {"read", "write"}
        assert all(s.end >= s.start and s.step >= 0 for s in disk_spans)
        # each span carries its record's bytes: every record of this rank's shards written once a step
        layout, owner = engine.ledger.disk.layout, engine.topology.owner_rank
        records = [rec for u in range(len(engine.layout.units)) for rec in layout.pieces(u, owner)]
        assert all(s.nbytes in {rec.nbytes for rec in layout.pieces(s.unit, owner)} for s in disk_spans)
        per_step = sum(rec.nbytes for rec in records)
        assert [sum(s.nbytes for s in disk_spans if s.name == "write" and s.step == k) for k in range(3)] == [
            per_step
        ] * 3

    (tmp_path / "state").mkdir()
    config = EngineConfig(state_dir=str(tmp_path / "state"), trace_dir=str(tmp_path / "trace"))
    run(config, steps=3, inspect=inspect)


def test_the_update_span_holds_the_kernel_not_the_wait_for_its_records_read(tmp_path: Path, monkeypatch) -> None:
    """With slow reads the update waits for its records: that wait is the disk lane's time (its read span), so no
    update span of a unit starts while a read of that unit is still under way (the lanes the step-time model is
    held against)."""
    read_into = disk.StateFile.read_into

    def slow(self, *args, **kwargs):
        time.sleep(0.05)
        return read_into(self, *args, **kwargs)

    monkeypatch.setattr(disk.StateFile, "read_into", slow)

    def inspect(engine, opt):
        reads = [s for s in engine.tracer.spans if s.lane == "disk" and s.name == "read"]
        updates = [s for s in engine.tracer.spans if s.lane == "update"]
        assert reads and updates
        inside = [(u, r) for u in updates for r in reads if r.unit == u.unit and r.start < u.start < r.end]
        assert not inside, inside[:3]

    (tmp_path / "state").mkdir()
    config = EngineConfig(state_dir=str(tmp_path / "state"), trace_dir=str(tmp_path / "trace"))
    run(config, steps=3, inspect=inspect)


def test_a_checkpoint_save_reads_the_state_file_with_its_pages_handed_back(tmp_path: Path, monkeypatch) -> None:
    """Saving moments kept on disk: DCP and the piece digests read the mapped state file only while its pages are
    handed back as they go (``DiskState.paged``), and after the save the mapping is gone: the process's
    file-backed memory is back where it was."""

    def rss_file() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile:"))

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_config(False, 1, vocab=1 << 18))  # 33.6 M parameters, 268 MB of moments
    (tmp_path / "state").mkdir()
    engine = SlideDPEngine(
        model, EngineConfig(state_dir=str(tmp_path / "state")), device=CPU, compute_dtype=torch.float32
    )
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine.attach_optimizer(opt)
        x = torch.randint(0, 1 << 18, (1, 8))
        model(input_ids=x, labels=x).loss.backward()
        assert engine.end_step()
        engine.synchronize()
        state = engine.ledger.disk
        assert state is not None
        outside: list[str] = []
        real_digest, real_save = checkpoint.tensor_digest, checkpoint.dcp.save

        def digest(tensor):
            if not state.paging:
                outside.append("a digest")
            return real_digest(tensor)

        def save(*args, **kwargs):
            if not state.paging:
                outside.append("DCP's save")
            return real_save(*args, **kwargs)

        monkeypatch.setattr(checkpoint, "tensor_digest", digest)
        monkeypatch.setattr(checkpoint.dcp, "save", save)
        base = rss_file()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            checkpoint.save(engine, {"state_dict": {}}, tmp_path / "ck")
        assert outside == [], f"{outside[0]} read the mapped state file without its pages handed back"
        assert rss_file() - base < 32 << 20, "the state file's mapping outlived the save"
    finally:
        engine.close(restore=False)


# -- the FP32 master on disk too (StateOnDisk(master=True)): bf16 compute, the BF16 copy alone in memory ----------
MASTER_KNOBS = [
    {},
    {"grad_route": "host_reduce", "chunk_bytes": 4096},
    {"update": "deferred", "accumulate": 2},
    {"param_route": "sharded", "prefetch_window": 1},
    {"optimizer_state": "int8"},
]


@pytest.mark.parametrize("pieces", ["whole", "16KiB"])
@pytest.mark.parametrize("knobs", MASTER_KNOBS, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()) or "default")
def test_the_master_on_disk_trains_bit_identically(tmp_path: Path, knobs: dict, pieces: str, monkeypatch) -> None:
    """The master, the moments and their scales in the state file: the same losses and FP32 weights (read back from
    the file) as the ledger in memory, record by record."""
    if pieces != "whole":
        monkeypatch.setattr(disk, "PIECE_BYTES", 16 << 10)
    ref = run(EngineConfig(**knobs), torch.bfloat16)
    got = run(EngineConfig(state_dir=str(tmp_path), master_on_disk=True, **knobs), torch.bfloat16)
    _assert_same(got, ref)
    assert got[3][0] > 0 and got[3][1] > 0 and os.listdir(tmp_path) == []


@pytest.mark.parametrize("state", ["fp32", "int8"])
def test_the_ledger_in_memory_keeps_only_the_bf16_copy(tmp_path: Path, state: str) -> None:
    ram = run(EngineConfig(optimizer_state=state), torch.bfloat16, steps=1)[2]
    disk_ = run(EngineConfig(optimizer_state=state, state_dir=str(tmp_path), master_on_disk=True), torch.bfloat16,
                steps=1)[2]  # fmt: skip
    per_param = 4 + (8 if state == "fp32" else 2 + 8 / 1024)
    saved = ram.nbytes - disk_.nbytes
    assert per_param * ram.padded_params <= saved <= per_param * ram.padded_params + 4 * 4096 * 2, (saved, ram)


@pytest.mark.parametrize("where", ["disk-disk", "disk-memory", "memory-disk"])
def test_a_checkpoint_resumes_bit_exact_wherever_the_master_lives(tmp_path: Path, where: str) -> None:
    state = tmp_path / "state"
    state.mkdir()
    saves, loads = where.split("-")
    config = {"disk": EngineConfig(state_dir=str(state), master_on_disk=True), "memory": EngineConfig()}
    straight = run(config[saves], torch.bfloat16, steps=6, save=tmp_path / "ck")
    resumed = run(config[loads], torch.bfloat16, steps=6, load=tmp_path / "ck")
    assert resumed[0] == straight[0][3:]
    assert all(torch.equal(resumed[1][k], straight[1][k]) for k in straight[1])
    assert os.listdir(state) == []


def test_weights_set_and_restored_at_close_go_through_the_master_on_disk(tmp_path: Path) -> None:
    """load_state_dict writes the master in the file (and its BF16 copy), the next step starts from it, and the model
    gets FP32 copies of the master read back from the file at close."""
    model = tiny_model(False, layers=2, seed=0)
    config = EngineConfig(state_dir=str(tmp_path), master_on_disk=True)
    engine = SlideDPEngine(model, config, device=CPU, compute_dtype=torch.bfloat16)
    try:
        engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        want = {k: v + 0.5 for k, v in engine.state_dict().items()}
        engine.load_state_dict(want)
        assert all(torch.equal(v, want[k]) for k, v in engine.state_dict().items())
        x = token_batches(1, 2, 16)[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=x, labels=x).loss.backward()
        assert engine.end_step()
        engine.synchronize()
        after = engine.state_dict()
        assert any(not torch.equal(after[k], want[k]) for k in want)  # trained from the weights set
    finally:
        engine.close(restore=True)
    assert all(torch.equal(v, after[k]) for k, v in model.state_dict().items() if k in after)


def test_the_master_on_disk_is_refused_without_bf16_compute_and_its_copy(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="computes in float32: use precision='bf16-mixed'"):
        SlideDPEngine(tiny_model(False), EngineConfig(state_dir=str(tmp_path), master_on_disk=True), device=CPU,
                      compute_dtype=torch.float32)  # fmt: skip
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="keep bf16_copy=True"):
        SlideDPOptions(optimizer_state=StateOnDisk(str(tmp_path), master=True), bf16_copy=False)
    with pytest.raises(ValueError, match="needs a state_dir and bf16_copy=True"):
        EngineConfig(master_on_disk=True)
    options = SlideDPOptions(optimizer_state=StateOnDisk(str(tmp_path), moments="int8", master=True))
    config = options.base_engine_config()
    assert config.master_on_disk and config.state_dir == str(tmp_path) and config.optimizer_state == "int8"


def test_an_export_reads_the_master_on_disk_a_tensor_at_a_time(tmp_path: Path, monkeypatch) -> None:
    """save_hf with the master on disk: each tensor read from the file as its shard is written and converted before
    the next is read (one FP32 copy at a time, never the whole model), and the export reloads to the weights the
    run ended with."""
    from transformers import AutoModelForCausalLM

    from slidedp_lightning.hf.export import save_hf
    from slidedp_lightning.runtime.ledger.state import LedgerState

    (tmp_path / "state").mkdir()
    reads: list[int] = []
    original = LedgerState.model_reader

    def counted(self, module):
        meta, read = original(self, module)

        def read_counted(names):
            reads.append(len(names))
            return read(names)

        return meta, read_counted

    monkeypatch.setattr(LedgerState, "model_reader", counted)
    exported = {}

    def inspect(engine, opt):
        save_hf(engine, tmp_path / "export", "fp32", max_shard_size=100_000)
        exported.update(engine.state_dict())

    run(EngineConfig(state_dir=str(tmp_path / "state"), master_on_disk=True), torch.bfloat16, steps=2, inspect=inspect)
    assert len(reads) > 3 and max(reads) == 1, reads  # tensor by tensor
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).state_dict()
    assert set(got) <= set(exported) and len(got) >= len(exported) - 1  # (a tied head is stored once)
    assert all(torch.equal(v, exported[k]) for k, v in got.items())
