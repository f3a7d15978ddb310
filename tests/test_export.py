"""Hugging Face export from the ledger: from_pretrained on it gives the training model's logits."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from slidedp_lightning import SaveHuggingFace
from tests.helpers import VOCAB, tiny_model
from tests.trainers import TinyLM, data, trainer  # noqa: F401

X = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))


class UntiedLM(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_model(tied=False)


@pytest.mark.parametrize("module_cls", [TinyLM, UntiedLM], ids=["tied", "untied"])
def test_fp32_export_reloads_with_the_training_models_logits(tmp_path, module_cls):
    module = module_cls()
    t = trainer(max_steps=3, callbacks=[SaveHuggingFace(tmp_path / "hf", dtype="fp32")])
    t.fit(module, data())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, attn_implementation="eager")
    # after fit the module holds FP32 copies of the ledger's master weights
    with torch.no_grad():
        expected, got = module.model(input_ids=X).logits, loaded(input_ids=X).logits
    assert torch.equal(got, expected)
    tied = module.model.config.tie_word_embeddings
    assert (loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()) == tied


def test_bf16_export_is_sharded_on_request_and_close_to_the_fp32_model(tmp_path):
    module = TinyLM()
    t = trainer(max_steps=2, callbacks=[SaveHuggingFace(tmp_path / "hf", every_n_train_steps=1)])
    t.fit(module, data())
    assert (tmp_path / "hf" / "step=1" / "config.json").is_file() and (tmp_path / "hf" / "step=2").is_dir()
    strategy_dir = tmp_path / "sharded"
    # a second export through the strategy while it still runs: small shards, with an index
    module2 = TinyLM()

    class Export(SaveHuggingFace):
        def on_train_end(self, trainer, pl_module):
            trainer.strategy.save_hf(strategy_dir, "bf16", max_shard_size=20_000)

    trainer(max_steps=1, callbacks=[Export(tmp_path / "unused")]).fit(module2, data())
    index = json.loads((strategy_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    config = json.loads((strategy_dir / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16, attn_implementation="eager")
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    with torch.no_grad():
        expected, got = module.model(input_ids=X).logits, loaded(input_ids=X).logits.float()
    assert (got - expected).abs().max().item() <= 0.05 * expected.abs().max().item()


def test_export_outside_a_run_and_with_another_strategy_is_refused(tmp_path):
    from slidedp_lightning import SlideDPStrategy

    with pytest.raises(RuntimeError, match="only while the Trainer runs"):
        SlideDPStrategy().save_hf(tmp_path)
    with pytest.raises(TypeError, match="SlideDP"):
        trainer(strategy="auto", max_steps=1, callbacks=[SaveHuggingFace(tmp_path)]).fit(TinyLM(), data())
    with pytest.raises(ValueError, match="every_n_train_steps"):
        SaveHuggingFace(tmp_path, every_n_train_steps=0)


@pytest.mark.parametrize("module_cls", [TinyLM, UntiedLM], ids=["tied", "untied"])
def test_offline_export_of_a_distributed_checkpoint_equals_the_live_export(tmp_path, module_cls):
    """``python -m slidedp_lightning.export`` writes, from the checkpoint alone, the files the running strategy
    writes from its ledger at the same step."""
    import lightning as L
    from safetensors.torch import load_file

    from slidedp_lightning.hf.export_cli import main

    class SaveBoth(L.Callback):
        def on_train_end(self, trainer, pl_module):
            trainer.save_checkpoint(tmp_path / "ck")
            trainer.strategy.save_hf(tmp_path / "live", "fp32")

    trainer(max_steps=3, callbacks=[SaveBoth()]).fit(module_cls(), data())
    assert main([str(tmp_path / "ck"), str(tmp_path / "offline"), "--dtype", "fp32"]) == 0
    live, offline = (
        load_file(tmp_path / "live" / "model.safetensors"),
        load_file(tmp_path / "offline" / "model.safetensors"),
    )
    assert sorted(live) == sorted(offline)
    assert all(torch.equal(live[n], offline[n]) for n in live)
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "offline", dtype=torch.float32, attn_implementation="eager"
    )
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "live", dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=X).logits, expected(input_ids=X).logits)


def test_offline_export_refuses_what_is_not_a_checkpoint(tmp_path):
    from slidedp_lightning.hf.export import export_checkpoint

    with pytest.raises(FileNotFoundError, match="not a SlideDP distributed checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "out")


def test_an_unfinished_export_leaves_nothing_and_says_what_it_could_not_remove(tmp_path, monkeypatch, caplog):
    """A failed export removes its hidden directory, what appeared while it was removed too; a directory that cannot
    be removed is named in a warning with the reason (the command's "nothing of the export left" would be wrong)."""
    import shutil

    from slidedp_lightning.hf import export

    out = tmp_path / "hf"
    with pytest.raises(RuntimeError, match="stopped"), export.export_directory(out) as tmp:
        (tmp / "model-00001.safetensors").write_bytes(b"x")
        raise RuntimeError("stopped")
    assert sorted(p.name for p in tmp_path.iterdir()) == [] and not out.exists()

    real, calls = shutil.rmtree, []

    def late_writer(path, **kw):  # a file appears in it while the first pass runs
        calls.append(path)
        real(path, **kw)
        if len(calls) == 1:
            path.mkdir()
            (path / "late").write_bytes(b"y")

    monkeypatch.setattr(export.shutil, "rmtree", late_writer)
    with pytest.raises(RuntimeError), export.export_directory(out) as tmp:
        raise RuntimeError("stopped")
    assert len(calls) == 2 and list(tmp_path.iterdir()) == []

    def refuses(path, **kw):
        handler = kw.get("onexc") or kw.get("onerror")
        handler(os.rmdir, str(path), PermissionError(13, "Permission denied"))

    monkeypatch.setattr(export.shutil, "rmtree", refuses)
    with pytest.raises(RuntimeError), export.export_directory(out) as tmp:
        raise RuntimeError("stopped")
    assert f"could not remove {tmp}, left by an unfinished export: {tmp}: [Errno 13] Permission denied" in caplog.text
