"""Distributed checkpoints: the balanced share, pieces read across layouts, metadata as JSON and tensors, and
checkpoints whose files were tampered with refused without running anything of them."""

from __future__ import annotations

import json
import pickle
import re
import shutil
import warnings

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint

from slidedp_lightning import SlideDPStrategy
from slidedp_lightning.checkpoints.distributed import FORMAT, LEGACY_META, META, TENSORS, read_meta, share
from slidedp_lightning.checkpoints.files import META_HASH, content_digest
from slidedp_lightning.checkpoints.json_codec import CheckpointContentError, decode, encode
from slidedp_lightning.checkpoints.ranges import parse_piece, piece_key, read_ranges
from slidedp_lightning.hf.export import export_checkpoint
from slidedp_lightning.runtime.compat import DCP_METADATA, UnsafeCheckpointError
from tests.trainers import (
    TinyLM,
    data,
    quiet_and_clean,  # noqa: F401
    trainer,
)


def test_share_balances_elements_and_is_deterministic():
    sizes = {"a": 100, "b": 60, "c": 50, "d": 10}
    assert share(sizes, 2) == [["a", "d"], ["b", "c"]] == share(dict(reversed(sizes.items())), 2)


def test_piece_keys_round_trip_and_other_keys_are_not_pieces():
    assert parse_piece(piece_key("exp_avg/model.layers.0.mlp.up_proj.weight", 3, 4096)) == (
        "exp_avg/model.layers.0.mlp.up_proj.weight",
        3,
        4096,
    )
    for other in ("model/w", "model/w@3", "model/w@a-4", "model/w@5-4", "model/w@-4"):
        assert parse_piece(other) is None, other


def _save_pieces(path, tensor: torch.Tensor, key: str, cuts: list[int]) -> None:
    """Write ``tensor`` flattened as the pieces between ``cuts``, as ranks of some layout would."""
    flat = tensor.reshape(-1)
    pieces = {piece_key(key, a, b): flat[a:b] for a, b in zip(cuts, cuts[1:]) if b > a}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(pieces, checkpoint_id=path, no_dist=True)


@pytest.mark.parametrize("cuts", [[0, 12], [0, 5, 12], [0, 1, 2, 7, 7, 11, 12]])
def test_ranges_are_read_from_whatever_pieces_overlap_them(tmp_path, cuts):
    full = torch.arange(12, dtype=torch.float32).reshape(3, 4) * 1.5
    _save_pieces(tmp_path, full, "model/w", cuts)
    wanted = [(0, 12), (0, 6), (6, 12), (2, 9), (11, 12)]
    outs = [torch.full((b - a,), -1.0) for a, b in wanted]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        read_ranges(tmp_path, [("model/w", a, b, out) for (a, b), out in zip(wanted, outs)], no_dist=True)
    for (a, b), out in zip(wanted, outs):
        assert torch.equal(out, full.reshape(-1)[a:b]), (cuts, a, b)


def test_a_signal_while_dcp_reads_is_raised_as_itself_not_wrapped(tmp_path, monkeypatch):
    """DCP turns any exception of a read, a KeyboardInterrupt too, into a CheckpointException (whose message is a
    traceback): a signal that lands inside DCP's read stays itself, so a CLI says "interrupted" and a run stops."""
    from slidedp_lightning.checkpoints import ranges as checkpoint_ranges

    _save_pieces(tmp_path, torch.arange(12, dtype=torch.float32), "model/w", [0, 12])

    def interrupted(self, read_item):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_ranges._RangeReads, "resolve_tensor", interrupted)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(KeyboardInterrupt):
            read_ranges(tmp_path, [("model/w", 0, 12, torch.empty(12))], no_dist=True)


def test_a_range_no_piece_covers_is_refused(tmp_path):
    full = torch.arange(12, dtype=torch.float32)
    flat = full.reshape(-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {piece_key("model/w", 0, 5): flat[0:5], piece_key("model/w", 7, 12): flat[7:12]},
            checkpoint_id=tmp_path,
            no_dist=True,
        )
        with pytest.raises(ValueError, match=r"holds 10 of the elements \[0, 12\) of model/w"):
            read_ranges(tmp_path, [("model/w", 0, 12, torch.empty(12))], no_dist=True)
        read_ranges(tmp_path, [("model/w", 7, 9, torch.empty(2))], no_dist=True)  # what is there reads


def test_metadata_round_trips_through_json_and_tensors():
    value = {
        "epoch": 3,
        "loops": {"fit_loop": {"state_dict": {}, "epoch_loop.batch_progress": {"total": {"ready": 7}}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": torch.tensor(0.25), "kth": None}},
        "optimizer_states": [{"state": {}, "param_groups": [{"betas": (0.9, 0.95), "lr": 1e-3, "params": [0, 1]}]}],
        "int_keys": {0: "a", (1, 2): [float("inf")]},
        "reserved": {"__tensor__": "not a reference"},
        "dtype": torch.bfloat16,
        "buffers": {"inv_freq": torch.arange(4, dtype=torch.bfloat16), "n": torch.tensor(5), "e": torch.zeros(0, 3)},
    }
    tensors: dict[str, torch.Tensor] = {}
    doc = encode(value, tensors)
    back = decode(json.loads(json.dumps(doc)), tensors)
    assert back.keys() == value.keys()
    assert back["int_keys"] == {0: "a", (1, 2): [float("inf")]}
    assert back["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert back["reserved"] == value["reserved"] and back["dtype"] is torch.bfloat16
    for name, t in value["buffers"].items():
        assert back["buffers"][name].dtype == t.dtype and torch.equal(back["buffers"][name], t), name
    assert torch.equal(back["callbacks"]["ModelCheckpoint{'monitor': None}"]["best_model_score"], torch.tensor(0.25))


def test_metadata_without_a_json_form_is_refused_naming_where_it_is():
    class Opaque:
        pass

    with pytest.raises(CheckpointContentError, match=r"checkpoint\['hyper_parameters'\]\['cfg'\] is a .*Opaque"):
        encode({"epoch": 1, "hyper_parameters": {"cfg": Opaque()}}, {})


# -- real checkpoints ---------------------------------------------------------------------------------------


class Payload:
    """Unpickling this writes the marker file: proof that a checkpoint file ran code."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A distributed checkpoint after 2 steps of the tiny model, written by Lightning's ModelCheckpoint."""
    return _save_after_two_steps(tmp_path_factory.mktemp("saved"))


def _save_after_two_steps(root):
    cb = ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1, filename="ck")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _checkpointing_trainer(max_steps=2, callbacks=[cb]).fit(TinyLM(), data())
    if dist.is_initialized():
        dist.destroy_process_group()
    return root / "ck.ckpt"


def _checkpointing_trainer(**kw) -> L.Trainer:
    kw.setdefault("strategy", "slidedp")
    return L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False, **kw
    )


def _copy(saved, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    return ck


def _resume(ck, **kw):
    trainer(max_steps=3, **kw).fit(TinyLM(), data(), ckpt_path=str(ck))


def test_a_checkpoint_holds_json_metadata_and_no_pickle_but_dcps_own(saved):
    assert {p.name for p in saved.iterdir() if not p.name.endswith(".distcp")} == {META, TENSORS, DCP_METADATA}
    doc = json.loads((saved / META).read_text())
    assert doc["slidedp"]["format"] == FORMAT and doc["global_step"] == 2 and "state_dict" not in doc
    meta = read_meta(saved)
    info = meta["slidedp"]
    assert info["step"] == 2 and info["params"]["model.model.embed_tokens.weight"] == [64, 64]
    assert all(isinstance(t, torch.Tensor) for t in info["buffers"].values())
    groups = meta["optimizer_states"][0]["param_groups"]
    assert groups[0]["betas"] == (0.9, 0.95) and groups[0]["weight_decay"] == 0.1
    keys = dcp.FileSystemReader(saved).read_metadata().state_dict_metadata
    assert piece_key("model/model.model.embed_tokens.weight", 0, 64 * 64) in keys
    assert all(parse_piece(k) for k in keys), "the ledger is stored as pieces only"


def test_the_checkpoint_resumes(saved, tmp_path):
    _resume(_copy(saved, tmp_path))


@pytest.mark.parametrize("target", [DCP_METADATA, META, TENSORS, LEGACY_META])
def test_a_pickle_payload_planted_in_a_checkpoint_is_refused_and_never_runs(saved, tmp_path, target):
    ck = _copy(saved, tmp_path)
    marker = tmp_path / "payload-ran"
    if target == LEGACY_META:  # a directory as format 1 wrote it: its metadata a pickle
        (ck / META).unlink()
    (ck / target).write_bytes(pickle.dumps({"slidedp": {"format": FORMAT}, "x": Payload(marker)}))
    expected = {
        DCP_METADATA: (UnsafeCheckpointError, r"names builtins\.exec.*refusing to load it"),
        META: (ValueError, rf"{META} is not JSON"),
        TENSORS: (ValueError, rf"{TENSORS} is not a safetensors file"),
        LEGACY_META: (ValueError, rf"format 1 .*reads formats 2 and {FORMAT} only"),
    }[target]
    with pytest.raises(expected[0], match=expected[1]):
        _resume(ck)
    if dist.is_initialized():
        dist.destroy_process_group()
    with pytest.raises(expected[0], match=expected[1]):
        export_checkpoint(ck, tmp_path / "hf")
    assert not marker.exists(), "loading the checkpoint ran the planted payload"


def test_a_checkpoint_of_another_format_is_refused_naming_both(saved, tmp_path):
    ck = _copy(saved, tmp_path)
    doc = json.loads((ck / META).read_text())
    doc["slidedp"]["format"] = FORMAT + 1
    doc["slidedp"][META_HASH] = content_digest(doc)  # as the release that wrote it would have
    (ck / META).write_text(json.dumps(doc))
    with pytest.raises(
        ValueError, match=rf"format {FORMAT + 1}; this version of slidedp-lightning reads formats 2 and {FORMAT} only"
    ):
        read_meta(ck)


def test_lightning_state_without_a_json_form_is_refused_at_save_and_nothing_is_written(tmp_path):
    class Opaque:
        pass

    class Keeps(TinyLM):
        def on_save_checkpoint(self, checkpoint):
            checkpoint["mine"] = {"thing": Opaque()}

    class SaveAtEnd(L.Callback):
        def on_train_end(self, trainer, pl_module):
            trainer.save_checkpoint(tmp_path / "ck")

    with pytest.raises(
        CheckpointContentError, match=r"checkpoint\['mine'\]\['thing'\] is a .*Opaque.*checkpoint_format='full'"
    ):
        trainer(max_steps=1, callbacks=[SaveAtEnd()]).fit(Keeps(), data())
    assert not list(tmp_path.iterdir()), "a refused save left files behind"


def test_a_full_checkpoint_loads_with_weights_only_and_a_planted_one_is_refused(tmp_path, monkeypatch):
    """checkpoint_format='full': the file SlideDP writes loads under torch.load(weights_only=True), and the
    strategy loads with weights_only=True unless told otherwise, even where the environment asks torch not to."""
    cb = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="full")
    _checkpointing_trainer(strategy=SlideDPStrategy(checkpoint_format="full"), max_steps=1, callbacks=[cb]).fit(
        TinyLM(), data()
    )
    ckpt = torch.load(tmp_path / "full.ckpt", weights_only=True)
    assert ckpt["global_step"] == 1 and ckpt["state_dict"] and ckpt["optimizer_states"][0]["state"]
    if dist.is_initialized():  # the strategy destroys the group it created at teardown
        dist.destroy_process_group()

    marker = tmp_path / "payload-ran"
    ckpt["planted"] = Payload(marker)
    torch.save(ckpt, tmp_path / "planted.ckpt")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        trainer(strategy=SlideDPStrategy(checkpoint_format="full"), max_steps=2).fit(
            TinyLM(), data(), ckpt_path=str(tmp_path / "planted.ckpt")
        )
    assert not marker.exists(), "loading the full checkpoint ran the planted payload"


def _stored_tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of an FP32-state checkpoint's ledger, whole, whatever pieces it was stored in."""
    sizes: dict[str, int] = {}
    for fqn in dcp.FileSystemReader(path).read_metadata().state_dict_metadata:
        key, _, stop = parse_piece(fqn)
        sizes[key] = max(sizes.get(key, 0), stop)
    out = {key: torch.empty(n) for key, n in sizes.items()}  # the exact mode: FP32 tensors only
    read_ranges(path, [(key, 0, n, out[key]) for key, n in sizes.items()], no_dist=True)
    return out


def test_parameters_are_stored_in_bounded_pieces_and_read_back_alike(saved, tmp_path, monkeypatch):
    """A parameter larger than PIECE_ELEMS is cut into pieces (a resume reads one piece at a time into memory),
    and the checkpoint holds the same tensors as one stored whole."""
    from slidedp_lightning.checkpoints import distributed as checkpoint

    monkeypatch.setattr(checkpoint, "PIECE_ELEMS", 1000)
    small = _save_after_two_steps(tmp_path / "small")
    keys = dcp.FileSystemReader(small).read_metadata().state_dict_metadata
    embed = sorted(p[1:] for p in map(parse_piece, keys) if p[0] == "model/model.model.embed_tokens.weight")
    assert embed == [(a, min(a + 1000, 64 * 64)) for a in range(0, 64 * 64, 1000)]
    assert all(p[2] - p[1] <= 1000 for p in map(parse_piece, keys))
    whole, cut = _stored_tensors(saved), _stored_tensors(small)
    assert whole.keys() == cut.keys()
    for key in whole:
        assert torch.equal(whole[key], cut[key]), key
    _resume(_copy(small, tmp_path))


# -- integrity: checksums, and errors that name the cause and the fix -------------------------------------------


def test_every_file_of_a_checkpoint_is_recorded_with_its_size_and_crc(saved):
    from slidedp_lightning.checkpoints.files import CHECKSUMS, file_checksum

    recorded = json.loads((saved / META).read_text())["slidedp"][CHECKSUMS]
    files = {p.name for p in saved.iterdir()} - {META}
    assert set(recorded) == files and any(n.endswith(".distcp") for n in files)
    assert all(recorded[n] == [(saved / n).stat().st_size, file_checksum(saved / n)] for n in files)


@pytest.mark.parametrize("where", ["distcp", "metadata", "tensors"])
def test_a_byte_flipped_in_a_checkpoint_file_is_refused_naming_the_file(saved, tmp_path, where):
    from slidedp_lightning.checkpoints.files import CorruptCheckpointError

    ck = _copy(saved, tmp_path)
    name = {"distcp": next(p.name for p in ck.glob("*.distcp")), "metadata": DCP_METADATA, "tensors": TENSORS}[where]
    data_ = bytearray((ck / name).read_bytes())
    data_[len(data_) * 2 // 3] ^= 0x10  # inside the tensor data, where nothing but a checksum notices
    (ck / name).write_bytes(bytes(data_))
    with pytest.raises((CorruptCheckpointError, ValueError, UnsafeCheckpointError)) as err:
        _resume(ck)
    if where == "distcp":  # today's code resumes from it silently
        assert isinstance(err.value, CorruptCheckpointError) and name in str(err.value), err.value
        assert "\n" not in str(err.value)


def test_every_stored_piece_is_recorded_with_the_xxh3_of_its_bytes(saved):
    from slidedp_lightning.checkpoints.files import PIECES, tensor_digest

    recorded = json.loads((saved / META).read_text())["slidedp"][PIECES]
    keys = dcp.FileSystemReader(saved).read_metadata().state_dict_metadata
    assert set(recorded) == set(keys)
    stored = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in keys.items()}
    dcp.load(stored, checkpoint_id=saved, no_dist=True)
    assert all(recorded[k] == tensor_digest(v) for k, v in stored.items())


def _flip_inside_a_piece(ck) -> str:
    name = next(p.name for p in ck.glob("*.distcp"))
    data_ = bytearray((ck / name).read_bytes())
    data_[len(data_) * 2 // 3] ^= 0x10  # inside the tensor data
    (ck / name).write_bytes(bytes(data_))
    return name


def _refused_naming(ck, name: str) -> str:
    from slidedp_lightning.checkpoints.files import CorruptCheckpointError

    with pytest.raises(CorruptCheckpointError) as err:
        _resume(ck)
    line = str(err.value)
    assert name in line and "resume from another checkpoint" in line and "\n" not in line, line
    return line


def test_a_flipped_byte_is_found_by_the_digest_of_the_piece_as_it_is_read(saved, tmp_path, monkeypatch):
    """A resume that reads each piece whole hashes it in the pass that reads it: no file is hashed again."""
    from slidedp_lightning.checkpoints import distributed as checkpoint

    hashed_files: list[str] = []
    original = checkpoint.verify_files
    monkeypatch.setattr(
        checkpoint, "verify_files", lambda p, e, names: hashed_files.extend(names) or original(p, e, names)
    )
    _resume(_copy(saved, tmp_path / "good"))
    assert not [n for n in hashed_files if n.endswith(".distcp")], hashed_files  # the pieces vouched for the files
    ck = _copy(saved, tmp_path / "bad")
    name = _flip_inside_a_piece(ck)
    assert re.search(r"recorded for \S+/\S+@\d+-\d+ \(the file is corrupted\)", _refused_naming(ck, name))


def test_a_resume_checks_and_unpickles_dcps_metadata_once(saved, tmp_path, monkeypatch):
    from slidedp_lightning.runtime import compat

    read: list[str] = []
    check = compat.check_dcp_metadata
    monkeypatch.setattr(compat, "check_dcp_metadata", lambda path: read.append(str(path)) or check(path))
    _resume(_copy(saved, tmp_path))
    assert len(read) == 1, read


def test_pieces_read_in_part_have_their_files_checked_whole(saved, tmp_path, monkeypatch):
    """Another layout reads stored pieces in part (here: every range cut in two): their files are hashed whole."""
    from slidedp_lightning.checkpoints import distributed as checkpoint

    held = checkpoint._held

    def halves(engine, writing=False):
        out = []
        for key, lo, hi, view in held(engine, writing):
            mid = lo + (hi - lo) // 2 + 1 if hi - lo > 2 else hi
            out += [(key, lo, mid, view[: mid - lo]), (key, mid, hi, view[mid - lo :])]
        return [w for w in out if w[2] > w[1]]

    monkeypatch.setattr(checkpoint, "_held", halves)
    _resume(_copy(saved, tmp_path / "good"))  # the halves read back what was saved
    ck = _copy(saved, tmp_path / "bad")
    name = _flip_inside_a_piece(ck)
    assert "does not match the XXH3-64 its save recorded (the file is corrupted)" in _refused_naming(ck, name)


def test_a_checkpoint_without_piece_digests_is_checked_file_by_file(saved, tmp_path):
    """A save by the release before piece digests (files hashed, pieces not) is still refused when damaged."""
    from slidedp_lightning.checkpoints.files import PIECES, content_digest

    ck = _copy(saved, tmp_path)
    doc = json.loads((ck / META).read_text())
    del doc["slidedp"][PIECES]
    doc["slidedp"][META_HASH] = content_digest(doc)
    (ck / META).write_text(json.dumps(doc, indent=1))
    name = _flip_inside_a_piece(ck)
    assert "does not match the XXH3-64 its save recorded (the file is corrupted)" in _refused_naming(ck, name)


def _refused_naming_meta(ck) -> str:
    from slidedp_lightning.checkpoints.files import CorruptCheckpointError

    with pytest.raises(CorruptCheckpointError) as err:
        read_meta(ck)
    line = str(err.value)
    assert f"{ck / META}" in line and "resume from another checkpoint" in line and "\n" not in line, line
    return line


@pytest.mark.slow
def test_a_bit_flipped_at_any_byte_of_meta_json_is_refused_or_changes_nothing(saved, tmp_path):
    """meta.json carries the XXH3-64 of its own content: a bit flipped at any byte of it (a step count, a learning rate,
    a file's checksum, the format, the hash or its key) is refused naming the file, unless the file still says the
    same (``1e-3`` and ``1E-3``)."""
    ck = _copy(saved, tmp_path)
    original = (ck / META).read_bytes()
    content = json.loads(original)
    assert content["slidedp"]["format"] == FORMAT and len(content["slidedp"][META_HASH]) == 16
    same = changed = 0
    for i in range(len(original)):
        flipped = bytearray(original)
        flipped[i] ^= 1 << (i % 8)
        (ck / META).write_bytes(bytes(flipped))
        try:
            unchanged = json.loads(bytes(flipped)) == content
        except ValueError:
            unchanged = False
        if unchanged:
            read_meta(ck)
            same += 1
        else:
            _refused_naming_meta(ck)
            changed += 1
    assert changed > 0.95 * len(original), (same, changed)


def test_an_edited_or_truncated_meta_json_is_refused_naming_it(saved, tmp_path):
    ck = _copy(saved, tmp_path)
    doc = json.loads((ck / META).read_text())
    doc["global_step"] += 1  # a well-formed edit: the hash of the content no longer matches
    (ck / META).write_text(json.dumps(doc, indent=1))
    assert "does not match the XXH3-64 of its content" in _refused_naming_meta(ck)
    with pytest.raises(ValueError, match="does not match the XXH3-64 of its content"):
        _resume(ck)
    with pytest.raises(ValueError, match="does not match the XXH3-64 of its content"):
        export_checkpoint(ck, tmp_path / "hf")
    del doc["slidedp"][META_HASH]  # the hash gone: format 3 always records it
    (ck / META).write_text(json.dumps(doc))
    assert f"is of format {FORMAT} and lacks" in _refused_naming_meta(ck)
    (ck / META).write_bytes((saved / META).read_bytes()[:-40])
    assert "is not JSON" in _refused_naming_meta(ck)


def test_a_format_2_checkpoint_without_the_hash_of_its_metadata_loads_with_a_warning(saved, tmp_path, caplog):
    """Earlier releases wrote format 2, whose meta.json carries no hash of itself: it still resumes, unverified (the
    other files are still checked against the checksums it records)."""
    ck = _copy(saved, tmp_path)
    doc = json.loads((ck / META).read_text())
    del doc["slidedp"][META_HASH]
    doc["slidedp"]["format"] = 2
    (ck / META).write_text(json.dumps(doc, indent=1))
    with caplog.at_level("WARNING", logger="slidedp_lightning.checkpoints.distributed"):
        assert read_meta(ck)["global_step"] == doc["global_step"]
    assert any("format 2" in r.message and "not verified" in r.message for r in caplog.records)
    _resume(ck)


def test_a_truncated_metadata_or_a_missing_meta_json_is_refused_in_one_line(saved, tmp_path):
    ck = _copy(saved, tmp_path)
    (ck / DCP_METADATA).write_bytes((ck / DCP_METADATA).read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"damaged: .*{DCP_METADATA}") as err:
        _resume(ck)
    assert "\n" not in str(err.value)
    ck2 = tmp_path / "ck2"
    shutil.copytree(saved, ck2)
    (ck2 / META).unlink()
    with pytest.raises(FileNotFoundError, match=f"no {META}: an incomplete checkpoint"):
        _resume(ck2)


class FrozenEmbed(TinyLM):
    def configure_model(self) -> None:
        self.model.get_input_embeddings().weight.requires_grad_(False)
        self.model.get_output_embeddings().weight.requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def test_resuming_with_a_different_frozen_set_names_the_frozen_parameters(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="frozen")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _checkpointing_trainer(max_steps=2, callbacks=[cb]).fit(FrozenEmbed(), data())
    if dist.is_initialized():
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="saved with .* parameter\\(s\\) frozen that this run trains") as err:
        _resume(tmp_path / "frozen.ckpt")
    assert "damaged" not in str(err.value) and "\n" not in str(err.value)


def test_a_directory_that_is_not_a_checkpoint_is_refused_naming_what_it_lacks(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=f"not a SlideDP distributed checkpoint \\(no {META}\\)"):
        _resume(tmp_path / "empty")


FULL_DISK_JOB = """
import sys, torch
from slidedp_lightning.checkpoints import distributed as sharded
from slidedp_lightning.runtime.engine import EngineConfig, SlideDPEngine
from tests.helpers import tiny_model
engine = SlideDPEngine(tiny_model(), EngineConfig(), device=torch.device("cpu"), compute_dtype=torch.float32)
try:
    sharded.save(engine, {}, sys.argv[1] + "/ck")
except OSError as err:
    print("ERR", err, flush=True)
    sys.exit(3)
finally:
    engine.close()
"""


@pytest.mark.slow
def test_a_full_disk_during_a_save_names_the_path_and_the_fix(tmp_path):
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (a small tmpfs in a user namespace)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    (tmp_path / "job.py").write_text(FULL_DISK_JOB)
    root = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    script = f"mount -t tmpfs -o size=64k tmpfs {mnt} && cd {root} && PYTHONPATH={root} {sys.executable} {tmp_path / 'job.py'} {mnt}"
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120)
    if "mount" in proc.stderr and proc.returncode != 3:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("ERR"))
    assert "no space left on the device of" in line and f"{mnt}/ck" in line, line


SECOND_SAVE_FULL_JOB = """
import shutil, sys, warnings
import lightning as L
from slidedp_lightning import SlideDPStrategy
from tests.trainers import TinyLM, data
mnt, fmt = sys.argv[1], sys.argv[2]
class SaveTwice(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        trainer.save_checkpoint(mnt + "/ck.ckpt")
        with open(mnt + "/filler", "wb") as f:  # another job's file takes the rest of the disk but 16 KiB
            f.write(bytes(shutil.disk_usage(mnt).free - (16 << 10)))
        print("FIRST SAVED", flush=True)
        trainer.save_checkpoint(mnt + "/ck.ckpt")
warnings.simplefilter("ignore")
t = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
              enable_checkpointing=False, strategy=SlideDPStrategy(checkpoint_format=fmt), max_steps=1,
              callbacks=[SaveTwice()])
try:
    t.fit(TinyLM(), data())
except OSError as err:
    print("ERR", err, flush=True)
    sys.exit(3)
"""


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["full", "distributed"])
def test_a_save_that_fills_the_disk_names_path_free_and_needed_bytes_and_keeps_the_previous_one(tmp_path, fmt):
    """A Trainer's save to a device with too little space left (a 4 MiB tmpfs in a user namespace): one line naming
    the path, the free and needed bytes and the fix, and the previous checkpoint at that path whole, nothing of the
    failed save left (torch alone says "enforce fail at inline_container.cc", and Lightning's copy leaves a
    truncated file in place of the previous one)."""
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (a small tmpfs in a user namespace)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    (tmp_path / "job.py").write_text(SECOND_SAVE_FULL_JOB)
    root = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    check = (
        f"import torch; torch.load('{mnt}/ck.ckpt', weights_only=True)"
        if fmt == "full"
        else f"from slidedp_lightning.checkpoints.distributed import read_meta, check_files; m = read_meta('{mnt}/ck.ckpt');"
        f"from pathlib import Path; f = m['slidedp']['files']; check_files(Path('{mnt}/ck.ckpt'), f, sorted(f))"
    )
    script = (
        f"mount -t tmpfs -o size=4m tmpfs {mnt} && cd {root} && export PYTHONPATH={root} && "
        f'{sys.executable} {tmp_path / "job.py"} {mnt} {fmt}; echo RC=$?; {sys.executable} -c "{check}" && '
        f"echo PREVIOUS LOADS; ls -A {mnt}"
    )
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    if "mount" in proc.stderr and "RC=" not in proc.stdout:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()[:200]}")
    out = proc.stdout
    assert "FIRST SAVED" in out and "RC=3" in out, out[-2000:] + proc.stderr[-3000:]
    line = next(x for x in out.splitlines() if x.startswith("ERR"))
    assert f"checkpoint {mnt}/ck.ckpt not written: no space left on the device of {mnt} (" in line, line
    assert re.search(r"\(\d+\.\d+ KiB free, it takes about \d+\.\d+ KiB\); free space there or write to", line)
    assert "(the previous one is kept)" in line and "inline_container" not in line
    assert "PREVIOUS LOADS" in out, out[-2000:] + proc.stderr[-3000:]
    assert out.split("PREVIOUS LOADS")[1].split() == ["ck.ckpt", "filler"], out  # no hidden partial file


def test_a_save_copies_no_ledger_piece_into_memory(tmp_path, monkeypatch):
    """DCP's writer clones a tensor whose storage is larger than it and keeps every tensor of a file until the file
    is written: the pieces handed to it alias the ledger with storages of their own size, so a save holds no copy
    of a rank's share (at 2.2 B parameters int8 the copies were 9 GB over both ranks)."""
    from slidedp_lightning.checkpoints.distributed import load, save
    from tests.helpers import tiny_model, token_batches
    from tests.runtime.helpers import adamw_groups, loss_of, make_engine

    model = tiny_model()
    engine = make_engine(model)
    try:
        engine.attach_optimizer(adamw_groups(model))
        x = token_batches(1, 2, 8)[0]
        loss_of(model, x).backward()
        assert engine.end_step()
        base = engine.ledger.mapping_address()
        clone, ledger_clones = torch.Tensor.clone, []

        def spy(t, *args, **kwargs):
            if t.untyped_storage().data_ptr() == base:
                ledger_clones.append(t.numel())
            return clone(t, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "clone", spy)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            save(engine, {"state_dict": {}}, tmp_path / "ck")
        monkeypatch.undo()
        assert ledger_clones == []
        before = {k: v.clone() for k, v in engine.state_dict().items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load(engine, tmp_path / "ck")
        assert all(torch.equal(v, engine.state_dict()[k]) for k, v in before.items())
    finally:
        engine.close()
