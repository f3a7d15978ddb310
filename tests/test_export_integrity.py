"""Exports are atomic and exact (never mixed with an earlier model's files), peft models export merged or as
adapters, LoRA on a from_pretrained base trains as torch's AdamW does, and the export CLI is warning-free."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

import slidedp_lightning
from slidedp_lightning import SaveHuggingFace, SlideDPStrategy
from slidedp_lightning.checkpoints import distributed as sharded
from slidedp_lightning.hf.export import check_export_target, save_hf
from slidedp_lightning.hf.export_cli import main as export_main
from slidedp_lightning.hf.pretrained import loading_into_ledger
from slidedp_lightning.runtime.engine import EngineConfig, SlideDPEngine
from tests.helpers import rel_err, token_batches
from tests.pretrained_checkpoints import VOCAB, index_of, reference, save

peft = pytest.importorskip("peft")

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]
X = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))


def weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``directory``."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def engine_of(model: torch.nn.Module) -> SlideDPEngine:
    return SlideDPEngine(model, EngineConfig(), device=CPU, compute_dtype=torch.float32)


def hidden_left(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


# -- item 1: atomic, exact ----------------------------------------------------------------------------------


@pytest.mark.parametrize("old_shard", ["60KB", "5GB"], ids=["over-sharded", "over-single"])
def test_an_export_into_a_model_directory_replaces_its_weights_whole(tmp_path, old_shard) -> None:
    """The old model's index and shards (or single file) go; both loaders read the new weights; the tokenizer stays."""
    target = save(tmp_path / "m", tied=False, dtype=torch.float32, seed=1, shard=old_shard)
    (target / "tokenizer.json").write_text("{}")
    new_shard = "5GB" if old_shard == "60KB" else 60_000
    model = AutoModelForCausalLM.from_pretrained(save(tmp_path / "new", False, torch.float32, seed=2))
    engine = engine_of(model)
    try:
        save_hf(engine, target, "fp32", max_shard_size=new_shard)
    finally:
        engine.close()
    names = {p.name for p in target.iterdir()}
    if old_shard == "60KB":
        assert "model.safetensors.index.json" not in names and names >= {"model.safetensors", "tokenizer.json"}
    else:
        assert "model.safetensors" not in names and len(set(index_of(target)["weight_map"].values())) > 1
    want = reference(tmp_path / "new")
    got = reference(target)  # transformers (model.safetensors first)
    with loading_into_ledger():
        skeleton = slidedp_lightning.from_pretrained(target)  # SlideDP (the index first)
    ledger = engine_of(skeleton)
    try:
        mine = ledger.state_dict()
    finally:
        ledger.close()
    assert all(torch.equal(got[n], want[n]) and torch.equal(mine[n], want[n]) for n in want)
    assert not hidden_left(tmp_path)


def test_an_interrupted_export_leaves_the_previous_directory_whole(tmp_path, monkeypatch) -> None:
    from slidedp_lightning.hf import export

    target = save(tmp_path / "m", tied=False, dtype=torch.float32, seed=1)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    written = []

    def dies_after_one(tensors, filename, metadata=None):
        if written:
            raise KeyboardInterrupt
        written.append(filename)
        return load_file.__globals__["save_file"](tensors, filename, metadata=metadata)

    monkeypatch.setattr(export, "save_file", dies_after_one)
    model = AutoModelForCausalLM.from_pretrained(target)
    engine = engine_of(model)
    try:
        with pytest.raises(KeyboardInterrupt):
            save_hf(engine, target, "fp32", max_shard_size=20_000)
    finally:
        engine.close()
    assert written and {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert not hidden_left(tmp_path)


def test_an_export_target_that_cannot_take_a_model_is_refused_in_one_line(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}")
    for path, cause in ((tmp_path / "file", "is not a directory"), (tmp_path / "data", "not a Hugging Face model")):
        with pytest.raises(OSError, match=cause) as err:
            check_export_target(path)
        assert "\n" not in str(err.value)
    with pytest.raises(OSError, match="is not a directory"):
        SaveHuggingFace(tmp_path / "file")  # at construction, before any training


class Pretrained(L.LightningModule):
    def __init__(self, directory: Path, lora: bool = False) -> None:
        super().__init__()
        self.directory, self.lora = directory, lora
        self.model: torch.nn.Module | None = None
        self.initial: dict[str, torch.Tensor] = {}

    def configure_model(self) -> None:
        if self.model is None:
            model = slidedp_lightning.from_pretrained(self.directory, attn_implementation="eager")
            if self.lora:
                torch.manual_seed(0)
                config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
                model = peft.get_peft_model(model, config)
            self.model = model

    def on_train_start(self) -> None:
        self.initial = self.trainer.strategy.engine.state_dict()

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def fit(module: L.LightningModule, *callbacks: L.Callback, steps: int = 2) -> L.Trainer:
    trainer = L.Trainer(
        strategy=SlideDPStrategy(),
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(torch.randint(0, VOCAB, (4, 8)), batch_size=2))
    return trainer


def test_a_fine_tune_in_place_starts_the_second_run_from_the_first_runs_weights(tmp_path) -> None:
    """``--model D --export D`` twice on a sharded D: the second run starts from what the first exported."""
    d = save(tmp_path / "D", tied=False, dtype=torch.float32)
    assert len(set(index_of(d)["weight_map"].values())) > 1
    first = Pretrained(d)
    fit(first, SaveHuggingFace(d, dtype="fp32"))
    exported = reference(d)
    second = Pretrained(d)
    fit(second, SaveHuggingFace(d, dtype="fp32"))
    assert all(torch.equal(second.initial[f"model.{n}"], exported[n]) for n in exported)
    assert not all(torch.equal(first.initial[f"model.{n}"], exported[n]) for n in exported)  # it trained


# -- item 2: peft --------------------------------------------------------------------------------------------


def lora_config() -> peft.LoraConfig:
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("meta_init", [False, True], ids=["from_pretrained", "meta_init"])
def test_lora_on_a_from_pretrained_base_trains_as_adamw_does(tmp_path, meta_init) -> None:
    """from_pretrained + get_peft_model inside the strategy's configure_model context: the adapters start from
    the values peft drew (meta_init: peft's own init at setup) and train as torch's AdamW on transformers' model."""
    d = save(tmp_path / "base", tied=False, dtype=torch.bfloat16)
    with loading_into_ledger(), torch.device("meta") if meta_init else torch.device("cpu"):
        torch.manual_seed(0)
        model = peft.get_peft_model(slidedp_lightning.from_pretrained(d, attn_implementation="eager"), lora_config())
    torch.manual_seed(0)
    ref = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager"), lora_config()
    )
    engine = engine_of(model)
    try:
        start = engine.state_dict()
        if meta_init:  # peft's init, drawn at setup: B is zero, A is not; the ref takes the same start
            assert all(not start[n].any() for n in start if "lora_B" in n)
            assert all(start[n].any() for n in start if "lora_A" in n)
            ref.load_state_dict(start)
        want0 = ref.state_dict()
        assert all(torch.equal(start[n], want0[n]) for n in want0), "initial weights differ"
        engine.attach_optimizer(adamw(model))
        ref_opt = adamw(ref)
        for x in token_batches(3, 2, 16, vocab=VOCAB):
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            assert engine.end_step()
            ref_opt.zero_grad()
            ref(input_ids=x, labels=x).loss.backward()
            ref_opt.step()
        got = engine.state_dict()
    finally:
        engine.close()
    want = ref.state_dict()
    assert all(rel_err(got[n], want[n]) <= 1e-5 for n in want)


def trained_lora(tmp_path: Path) -> tuple[torch.nn.Module, SlideDPEngine, torch.nn.Module]:
    """A peft model trained 2 steps by the engine (still open), and a copy merged by peft itself."""
    d = save(tmp_path / "base", tied=False, dtype=torch.float32)

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        return peft.get_peft_model(base, lora_config())

    model = build()
    engine = engine_of(model)
    engine.attach_optimizer(adamw(model))
    for x in token_batches(2, 2, 16, vocab=VOCAB):
        model(input_ids=x, labels=x).loss.backward()
        engine.end_step()
    twin = build()
    twin.load_state_dict(engine.state_dict())
    return model, engine, twin.merge_and_unload()


def test_a_lora_model_exports_merged_and_as_adapters(tmp_path) -> None:
    model, engine, merged = trained_lora(tmp_path)
    try:
        save_hf(engine, tmp_path / "merged", "fp32")
        save_hf(engine, tmp_path / "adapter", "fp32", adapter_only=True)
    finally:
        engine.close()
    loaded, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        want = merged(input_ids=X).logits
        assert torch.equal(loaded(input_ids=X).logits, want)
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32, attn_implementation="eager")
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
        assert rel_err(adapted(input_ids=X).logits, want) <= 1e-5


def test_the_export_cli_merges_a_lora_checkpoint(tmp_path) -> None:
    model, engine, merged = trained_lora(tmp_path)
    try:
        sharded.save(engine, {}, tmp_path / "ck")
        save_hf(engine, tmp_path / "live", "fp32")
    finally:
        engine.close()
    assert export_main([str(tmp_path / "ck"), str(tmp_path / "offline"), "--dtype", "fp32"]) == 0
    live, offline = weights(tmp_path / "live"), weights(tmp_path / "offline")
    assert sorted(live) == sorted(offline) and all(torch.equal(live[n], offline[n]) for n in live)
    assert export_main([str(tmp_path / "ck"), str(tmp_path / "adapter"), "--dtype", "fp32", "--adapter-only"]) == 0
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4


@pytest.mark.slow
def test_the_export_cli_runs_warning_free_and_names_a_bad_checkpoint_in_one_line(tmp_path) -> None:
    (tmp_path / "notack").mkdir()
    cmd = [sys.executable, "-W", "error::RuntimeWarning", "-m", "slidedp_lightning.export"]
    proc = subprocess.run(
        [*cmd, str(tmp_path / "notack"), str(tmp_path / "out")], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 2 and "found in sys.modules" not in proc.stderr, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("python -m slidedp_lightning.export: error:")]
    assert "no meta.json" in line and "pass the directory" in line, proc.stderr
    assert not (tmp_path / "out").exists()


def _checkpoint_of_a_small_model(path: Path, layers: int = 2) -> None:
    from tests.helpers import tiny_model

    engine = engine_of(tiny_model(False, layers=layers))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sharded.save(engine, {}, path)
    finally:
        engine.close()


@pytest.mark.slow
def test_the_export_cli_on_a_full_disk_says_so_in_one_line_and_leaves_nothing(tmp_path) -> None:
    """The export CLI writing to a device with too little space (a 64 KiB tmpfs in a user namespace): one line naming
    the path, the free and needed bytes and the fix; no directory, hidden or not, left on the device."""
    import shutil

    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (a small tmpfs in a user namespace)")
    _checkpoint_of_a_small_model(tmp_path / "ck")
    mnt = tmp_path / "small"
    mnt.mkdir()
    script = (
        f"mount -t tmpfs -o size=64k tmpfs {mnt} && cd {ROOT} && {sys.executable} -m slidedp_lightning.export "
        f"{tmp_path / 'ck'} {mnt / 'hf'} --dtype fp32; echo RC=$?; ls -A {mnt}"
    )
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    if "mount" in proc.stderr and "RC=" not in proc.stdout:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()[:200]}")
    assert proc.stdout.split() == ["RC=2"], proc.stdout + proc.stderr[-3000:]  # and nothing left on the device
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("python -m slidedp_lightning.export: error:")]
    assert f"Hugging Face export {mnt / 'hf'} not written: no space left on the device of {mnt} (" in line, line
    assert "KiB free, it takes about" in line and "free space there or write to another directory" in line, line


@pytest.mark.slow
@pytest.mark.parametrize("signum", [2, 15], ids=["SIGINT", "SIGTERM"])
def test_the_export_cli_interrupted_midway_leaves_the_previous_export_whole_and_nothing_else(tmp_path, signum) -> None:
    """SIGINT or SIGTERM while the CLI writes its shards (one file per tensor): the previous export at that path is
    byte for byte what it was, no hidden directory is left, and the CLI says so in one line."""
    import signal
    import time

    _checkpoint_of_a_small_model(tmp_path / "ck", layers=8)
    out = tmp_path / "hf"
    assert export_main([str(tmp_path / "ck"), str(out), "--dtype", "bf16"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    cmd = [sys.executable, "-m", "slidedp_lightning.export", str(tmp_path / "ck"), str(out), "--dtype", "fp32"]
    proc = subprocess.Popen([*cmd, "--max-shard-size", "1KB"], stderr=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.monotonic() + 120
    while not any(p.glob("model-00002-*") for p in tmp_path.glob(".hf.tmp-*")) and proc.poll() is None:
        assert time.monotonic() < deadline, "the export wrote no second shard within 120 s"
        time.sleep(0.005)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err[-3000:]
    (line,) = [x for x in err.splitlines() if x.startswith("python -m slidedp_lightning.export: interrupted")]
    assert signal.Signals(signum).name in line and f"{out} is unchanged" in line, line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not hidden_left(tmp_path)


@pytest.mark.parametrize("when", ["before the first shard", "after the last shard"])
def test_a_stop_asked_for_ends_the_export_and_leaves_the_previous_one(tmp_path, monkeypatch, when) -> None:
    """The CLI's signal handler also sets an event: a stop whose exception was lost (raised inside a finalizer,
    which Python ignores) still ends the export before the next shard or before the swap, never after it."""
    import threading

    from slidedp_lightning.hf import export as hf_export

    _checkpoint_of_a_small_model(tmp_path / "ck")
    out = tmp_path / "hf"
    assert export_main([str(tmp_path / "ck"), str(out), "--dtype", "bf16"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    stop = threading.Event()
    if when == "before the first shard":
        stop.set()
    else:
        write = hf_export.write_hf

        def write_then_stop(*args, **kwargs):
            write(*args, **kwargs)
            stop.set()  # as if a SIGTERM's exception had vanished while the last shard was written

        monkeypatch.setattr(hf_export, "write_hf", write_then_stop)
    with pytest.raises(hf_export.ExportStopped, match="was stopped"):
        hf_export.export_checkpoint(tmp_path / "ck", out, "fp32", stop=stop)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "hf"]  # no hidden directory left
