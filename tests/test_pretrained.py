"""slidedp_lightning.from_pretrained: a checkpoint read straight into the ledger, bit for bit what transformers
loads; clear errors before any ledger exists; the naive path warned about; outside SlideDP, transformers itself."""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import slidedp_lightning
from slidedp_lightning import SlideDPStrategy
from slidedp_lightning.hf.pretrained import CheckpointError, loading_into_ledger, warn_if_materialized
from slidedp_lightning.models import adapter_for
from slidedp_lightning.runtime import EngineConfig, SlideDPEngine, Topology
from slidedp_lightning.runtime.host_os import format_bytes
from slidedp_lightning.runtime.layout import build_layout
from slidedp_lightning.runtime.ledger.initial_weights import InitialWeights
from slidedp_lightning.runtime.ledger.weight_source import WEIGHT_SOURCE_ATTR
from tests.pretrained_checkpoints import VOCAB, config, index_of, reference, save

CPU = torch.device("cpu")


def skeleton(directory: Path, **kwargs) -> torch.nn.Module:
    with loading_into_ledger():
        return slidedp_lightning.from_pretrained(directory, **kwargs)


def engine_for(model: torch.nn.Module, **cfg) -> SlideDPEngine:
    return SlideDPEngine(model, EngineConfig(**cfg), device=CPU, compute_dtype=torch.float32)


def own_ledgers() -> set[str]:
    """This process's ledger files (other tests of the machine may create theirs meanwhile)."""
    return {p for p in glob.glob("/dev/shm/slidedp-*") if f"-{os.getpid()}-" in os.path.basename(p)}


def rewrite(path: Path, change) -> None:
    """Rewrite one safetensors file through ``change(tensors) -> tensors``."""
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(change(tensors), str(path), metadata={"format": "pt"})


def shard_holding(directory: Path, key: str) -> Path:
    return directory / index_of(directory)["weight_map"][key]


def write_index(directory: Path, weight_map: dict) -> None:
    data = index_of(directory)
    data["weight_map"] = weight_map
    (directory / "model.safetensors.index.json").write_text(json.dumps(data))


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return save(tmp_path / "bf16-untied", tied=False, dtype=torch.bfloat16)


# -- exactness ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_the_fp32_master_is_what_transformers_loads_bit_for_bit(tmp_path, tied, dtype) -> None:
    directory = save(tmp_path / "ckpt", tied, dtype)
    assert len(index_of(directory)["weight_map"]) > 0 and len(set(index_of(directory)["weight_map"].values())) >= 2
    expected = reference(directory)
    model = skeleton(directory)
    assert all(p.is_meta for p in model.parameters())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    engine = engine_for(model)
    try:
        got = engine.state_dict()
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        assert params <= set(got) and params <= set(expected)
        for name in params:
            assert torch.equal(got[name], expected[name]), name
        ledger = engine.ledger
        assert torch.equal(ledger.bf16, ledger.master.to(torch.bfloat16))  # the BF16 copy refreshed from it
        assert not ledger.exp_avg.any() and not ledger.exp_avg_sq.any()
        reference_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True)
        x = torch.randint(0, VOCAB, (2, 8))
        with torch.no_grad():  # buffers (rotary frequencies) recomputed alike
            assert torch.equal(model(input_ids=x).logits, reference_model(input_ids=x).logits)
    finally:
        engine.close(restore=False)
    assert not own_ledgers()


def test_the_skeleton_is_configured_as_from_pretrained_configures_it(ckpt) -> None:
    expected = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, local_files_only=True)
    model = skeleton(ckpt, attn_implementation="eager")
    assert type(model) is type(expected)
    assert model.training is expected.training is False
    assert model.config.to_dict() | {"_attn_implementation": None} == expected.config.to_dict() | {
        "_attn_implementation": None
    }
    assert model.config._attn_implementation == "eager"
    assert model.generation_config.to_dict() == expected.generation_config.to_dict()
    assert {n for n, _ in model.named_parameters()} == {n for n, _ in expected.named_parameters()}
    assert getattr(model, WEIGHT_SOURCE_ATTR).names() == {n for n, _ in model.named_parameters(remove_duplicate=False)}


def test_outside_slidedp_it_is_transformers_from_pretrained(ckpt) -> None:
    model = slidedp_lightning.from_pretrained(ckpt, attn_implementation="eager")
    expected = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, local_files_only=True, attn_implementation="eager"
    )
    assert type(model) is type(expected) and not hasattr(model, WEIGHT_SOURCE_ATTR)
    assert model.config._attn_implementation == "eager"
    got, want = model.state_dict(), expected.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == torch.float32 for k in want)
    with pytest.raises(OSError):  # transformers' own error for a hub id that is not cached, offline (HF_HUB_OFFLINE)
        slidedp_lightning.from_pretrained("no-such-org/no-such-model")


# -- tied weights as transformers ties them ----------------------------------------------------------------


def _single_file(directory: Path, tensors: dict[str, torch.Tensor], tied: bool) -> Path:
    directory.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    config(tied).save_pretrained(directory)
    return directory


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in Qwen3ForCausalLM(config(False)).state_dict().items()}


@pytest.mark.parametrize("case", ["both-equal", "both-different", "head-only"])
def test_tied_weights_follow_transformers(tmp_path, case, caplog) -> None:
    tensors = _tensors()
    if case == "both-equal":
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    elif case == "head-only":
        del tensors["model.embed_tokens.weight"]
    directory = _single_file(tmp_path / case, tensors, tied=True)
    expected_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True)
    with caplog.at_level(logging.WARNING, logger="slidedp_lightning"):
        model = skeleton(directory)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert (
        tied
        == (expected_model.lm_head.weight is expected_model.model.embed_tokens.weight)
        == (case != "both-different")
    )
    assert ("NOT tie them" in caplog.text) == (case == "both-different")
    engine = engine_for(model)
    try:
        got, want = engine.state_dict(), expected_model.state_dict()
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(got[name], want[name]), name
    finally:
        engine.close(restore=False)


# -- errors, before any ledger exists ----------------------------------------------------------------------


def _drop(key: str):
    return lambda t: {k: v for k, v in t.items() if k != key}


def _missing(directory: Path) -> str:
    key = "model.layers.1.mlp.up_proj.weight"
    rewrite(shard_holding(directory, key), _drop(key))
    write_index(directory, {k: v for k, v in index_of(directory)["weight_map"].items() if k != key})
    return key


def _unexpected(directory: Path) -> str:
    key = "model.layers.7.mlp.up_proj.weight"
    path = shard_holding(directory, "model.norm.weight")
    rewrite(path, lambda t: {**t, key: torch.zeros(3, 3, dtype=torch.bfloat16)})
    write_index(directory, {**index_of(directory)["weight_map"], key: path.name})
    return key


def _mismatched(directory: Path) -> str:
    key = "model.layers.0.self_attn.q_norm.weight"
    rewrite(shard_holding(directory, key), lambda t: {**t, key: torch.ones(8, dtype=torch.bfloat16)})
    return key


def _truncated(directory: Path) -> str:
    path = shard_holding(directory, "model.layers.0.mlp.down_proj.weight")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    return path.name


def _garbage(directory: Path) -> str:
    path = shard_holding(directory, "model.norm.weight")
    path.write_bytes(b"not a safetensors file")
    return path.name


def _shard_gone(directory: Path) -> str:
    path = shard_holding(directory, "model.norm.weight")
    path.unlink()
    return path.name


def _no_safetensors(directory: Path) -> str:
    for p in directory.glob("model*.safetensors*"):
        p.unlink()
    (directory / "pytorch_model.bin").write_bytes(b"")
    return "pytorch_model.bin"


def _misplaced(directory: Path) -> str:
    weight_map = index_of(directory)["weight_map"]
    key = "model.norm.weight"
    other = next(f for f in sorted(set(weight_map.values())) if f != weight_map[key])
    write_index(directory, {**weight_map, key: other})
    return key


def _int_weights(directory: Path) -> str:
    key = "model.norm.weight"
    rewrite(shard_holding(directory, key), lambda t: {**t, key: torch.ones(64, dtype=torch.int32)})
    return key


BREAK = {
    "missing": _missing,
    "unexpected": _unexpected,
    "shape": _mismatched,
    "truncated": _truncated,
    "not-safetensors": _garbage,
    "shard-gone": _shard_gone,
    "no-safetensors": _no_safetensors,
    "index-misplaces": _misplaced,
    "integer-dtype": _int_weights,
}


@pytest.mark.parametrize("case", list(BREAK))
def test_a_broken_checkpoint_is_refused_naming_the_tensor_or_file(ckpt, case) -> None:
    named = BREAK[case](ckpt)
    with pytest.raises(CheckpointError, match=named.replace(".", r"\.")):
        skeleton(ckpt)
    assert not own_ledgers()


def test_a_hub_id_or_a_file_is_not_a_checkpoint_directory(ckpt) -> None:
    with pytest.raises(CheckpointError, match="no-such-org/no-such-model.*downloads nothing"):
        skeleton("no-such-org/no-such-model")
    with pytest.raises(CheckpointError, match="config.json.*not a local directory"):
        skeleton(ckpt / "config.json")


def test_options_that_place_or_fetch_weights_are_refused(ckpt) -> None:
    with pytest.raises(TypeError, match="device_map"):
        skeleton(ckpt, device_map="cpu")
    with pytest.raises(TypeError, match="dtype"):
        skeleton(ckpt, dtype=torch.bfloat16)


def test_a_conversion_transformers_applies_at_load_is_refused_naming_the_model_type(tmp_path) -> None:
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path / "moe")  # per-expert tensors, stacked by transformers at load
    with pytest.raises(CheckpointError, match="qwen3_moe.*transformers' from_pretrained"):
        skeleton(tmp_path / "moe")


def test_a_file_broken_after_from_pretrained_fails_setup_and_leaves_no_ledger(ckpt) -> None:
    model = skeleton(ckpt)
    _truncated(ckpt)
    with pytest.raises(CheckpointError, match="model-0000"):
        engine_for(model)
    assert not own_ledgers()


# -- the naive path ------------------------------------------------------------------------------------------


def test_the_naive_path_is_warned_about_once_naming_the_memory_and_the_fix(ckpt, caplog) -> None:
    two = Topology(global_rank=0, local_rank=0, ranks_per_host=2)
    naive = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, local_files_only=True)
    fp32 = sum(p.numel() for p in naive.parameters()) * 4
    with caplog.at_level(logging.WARNING, logger="slidedp_lightning"):
        warn_if_materialized(naive, two)
        warn_if_materialized(naive, two)  # a later run on the same model: its restored weights
        warn_if_materialized(skeleton(ckpt), two)
        warn_if_materialized(AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True), Topology())
        warn_if_materialized(
            AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True),
            Topology(global_rank=1, local_rank=1, ranks_per_host=2),
        )
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, caplog.text
    text = warned[0].getMessage()
    assert "slidedp_lightning.from_pretrained" in text
    assert f"2 ranks x {format_bytes(fp32)} of FP32" in text and f"= {format_bytes(2 * fp32)} of host memory" in text
    assert "0.00 GiB" not in text and re.search(r"2 ranks x \d+\.\d\d (KiB|MiB) of FP32", text)  # a tiny model


def test_a_rank_that_does_not_write_the_ledger_frees_its_copy_first(ckpt) -> None:
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, local_files_only=True)
    specs = adapter_for(model).units(model)
    layout = build_layout(model, specs, 2)
    second = Topology(global_rank=1, local_rank=1, ranks_per_host=2)
    nbytes = sum(p.numel() for p in model.parameters()) * 4
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    assert InitialWeights(model, adapter_for(model), layout, Topology(ranks_per_host=1)).release_unwritten() == 0
    assert InitialWeights(model, adapter_for(model), layout, second).release_unwritten() == nbytes
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight.shape == (VOCAB, 64) and model.lm_head.weight.requires_grad
    assert torch.equal(model.model.rotary_emb.inv_freq, inv_freq)  # buffers stay


# -- progress and the recipe ---------------------------------------------------------------------------------


def test_loading_and_meta_init_log_their_time_and_rate(ckpt, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="slidedp_lightning"):
        engine_for(skeleton(ckpt)).close(restore=False)
        with torch.device("meta"):
            meta = Qwen3ForCausalLM(config(False))
        engine_for(meta).close(restore=False)
    messages = [r.getMessage() for r in caplog.records]
    sized = r"\d+(\.\d\d)? (B|KiB|MiB|GiB)"  # format_bytes: the unit that keeps the number at least 1
    rate = re.compile(rf"{sized} in \d+\.\d\d m?s \({sized}/s\)")  # under 10 ms: in ms
    read = [m for m in messages if m.startswith("SlideDP read checkpoint")]
    init = [m for m in messages if m.startswith("SlideDP initialized")]
    assert read and init, messages
    for m in read + init:
        assert rate.search(m) and " 0.00 " not in m, m
    assert re.search(rf"\(\d+ file\(s\), {sized} BF16\)", read[0]), read[0]


def test_the_recipe_builds_its_model_through_from_pretrained(ckpt) -> None:
    from slidedp_lightning.recipes.finetune import FinetuneModule

    module = FinetuneModule(model_dir=str(ckpt))
    with loading_into_ledger():
        module.configure_model()
    assert all(p.is_meta for p in module.model.parameters()) and hasattr(module.model, WEIGHT_SOURCE_ATTR)
    plain = FinetuneModule(model_dir=str(ckpt))
    plain.configure_model()
    assert not any(p.is_meta for p in plain.model.parameters())


# -- through Lightning ----------------------------------------------------------------------------------------


class Pretrained(L.LightningModule):
    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory
        self.model: torch.nn.Module | None = None
        self.initial: dict[str, torch.Tensor] = {}

    def configure_model(self) -> None:
        if self.model is None:
            self.model = slidedp_lightning.from_pretrained(self.directory, attn_implementation="eager")

    def on_train_start(self) -> None:
        self.initial = self.trainer.strategy.engine.state_dict()

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_a_one_device_trainer_starts_from_the_checkpoint(ckpt) -> None:
    module = Pretrained(ckpt)
    trainer = L.Trainer(
        strategy=SlideDPStrategy(),
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(torch.randint(0, VOCAB, (2, 8)), batch_size=2))
    expected = reference(ckpt)
    assert module.initial
    for name, value in module.initial.items():
        assert torch.equal(value, expected[name.removeprefix("model.")]), name
    assert not own_ledgers()


class StandStill(Pretrained):
    """Trains at learning rate 0 without weight decay: every update leaves the weights exactly as loaded."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.0, weight_decay=0.0)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_two_steps_at_lr_0_export_the_bf16_checkpoint_bit_for_bit(tmp_path, tied) -> None:
    from slidedp_lightning import SaveHuggingFace

    source = save(tmp_path / "source", tied=tied, dtype=torch.bfloat16)
    assert len(set(index_of(source)["weight_map"].values())) >= 2  # two safetensors shards at least
    trainer = L.Trainer(
        strategy=SlideDPStrategy(),
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SaveHuggingFace(tmp_path / "export", dtype="bf16")],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(StandStill(source), DataLoader(torch.randint(0, VOCAB, (4, 8)), batch_size=2))
    assert trainer.global_step == 2
    stored: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index_of(source)["weight_map"].values())):
        with safe_open(str(source / shard), "pt") as f:
            stored.update({k: f.get_tensor(k) for k in f.keys()})
    exported: dict[str, torch.Tensor] = {}
    for path in sorted((tmp_path / "export").glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            exported.update({k: f.get_tensor(k) for k in f.keys()})
    assert set(exported) == set(stored)
    for name, value in stored.items():
        assert exported[name].dtype == torch.bfloat16, name
        assert torch.equal(exported[name].view(torch.int16), value.view(torch.int16)), f"{name} changed"
    assert not own_ledgers()
