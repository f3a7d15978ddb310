"""JSONL data for ``slidedp-finetune --data``: exact label masks for both schemas, errors naming file and line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from slidedp_lightning.recipes.data import DataError, JsonlDataset, encode, read_jsonl
from slidedp_lightning.recipes.synthetic import IGNORE_INDEX
from slidedp_lightning_cli.finetune import main

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # merges across the prompt/answer boundary ("=4", "ant\n") exist, so a whole-text tokenization would differ
    tok.train_from_iterator(["what is 2+2=4", "user assistant system\nhello there=4 ant\nant\n"] * 50, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=chat_template
    )


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


def _write(path, lines: list[str | bytes]) -> str:
    with open(path, "wb") as f:
        for line in lines:
            f.write((line if isinstance(line, bytes) else line.encode()) + b"\n")
    return str(path)


def _labeled_text(tok, ids: list[int], labels: list[int]) -> tuple[str, str]:
    """(text of the labeled tokens, text of the others), each decoded as one run."""
    on = [t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX]
    off = [t for t, lab in zip(ids, labels, strict=True) if lab == IGNORE_INDEX]
    return tok.decode(on), tok.decode(off)


def test_prompt_completion_mask_is_exact(tok, tmp_path):
    path = _write(tmp_path / "d.jsonl", [json.dumps({"prompt": "what is 2+2=", "completion": "4"})])
    (record,) = read_jsonl(path)
    ids, labels = encode(tok, record)
    prompt = tok("what is 2+2=", add_special_tokens=False)["input_ids"]
    answer = tok("4", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ids == prompt + answer
    assert labels == [IGNORE_INDEX] * len(prompt) + answer
    assert _labeled_text(tok, ids, labels) == ("4<|endoftext|>", "what is 2+2=")


def test_messages_mask_covers_exactly_the_assistant_turns(tok, tmp_path):
    messages = [
        {"role": "system", "content": "hello"},
        {"role": "user", "content": "what is 2+2"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "there"},
        {"role": "assistant", "content": "ant"},
    ]
    path = _write(tmp_path / "d.jsonl", [json.dumps({"messages": messages})])
    (record,) = read_jsonl(path)
    ids, labels = encode(tok, record)
    assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False)
    # label runs, in order: each assistant content with its end-of-turn text, nothing else
    runs, cur = [], []
    for t, lab in zip(ids, labels, strict=True):
        if lab != IGNORE_INDEX:
            assert lab == t
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    assert runs == ["4<|im_end|>\n", "ant<|im_end|>\n"]
    # each assistant span starts where the generation prompt of its prefix ends
    prefix = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    first = next(i for i, lab in enumerate(labels) if lab != IGNORE_INDEX)
    assert tok.decode(ids[:first]) == prefix


def test_dataset_rows_are_right_padded(tok, tmp_path):
    lines = [
        json.dumps({"prompt": "what is 2+2=", "completion": "4"}),
        "",  # blank lines are skipped
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "4"}]}),
    ]
    data = JsonlDataset(_write(tmp_path / "d.jsonl", lines), tok, seq_len=24)
    assert len(data) == 2
    for i in range(2):
        item = data[i]
        n = int(item["attention_mask"].sum())
        assert item["attention_mask"][:n].eq(1).all() and item["attention_mask"][n:].eq(0).all()
        assert item["labels"][n:].eq(IGNORE_INDEX).all()
        assert item["input_ids"][n:].eq(tok.pad_token_id).all()
        assert (item["labels"][:n] != IGNORE_INDEX).any()
    assert data.input_ids.shape == (2, 24) and data.input_ids.dtype == torch.int64


def _error(tmp_path, tok, lines, seq_len=64, name="bad.jsonl") -> str:
    path = _write(tmp_path / name, lines)
    with pytest.raises(DataError) as err:
        JsonlDataset(path, tok, seq_len)
    return str(err.value)


GOOD = json.dumps({"prompt": "what is 2+2=", "completion": "4"})


def test_missing_file(tok, tmp_path):
    path = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="no such file") as err:
        JsonlDataset(path, tok, 64)
    assert str(err.value).startswith(f"{path}: ")


def test_empty_file(tok, tmp_path):
    msg = _error(tmp_path, tok, ["", "  "])
    assert msg.startswith(str(tmp_path / "bad.jsonl") + ": ") and "empty file" in msg


@pytest.mark.parametrize(
    "line, needle",
    [
        ('{"prompt": "a", ', "invalid JSON"),
        (json.dumps({"text": "a"}), "neither schema"),
        (json.dumps([1, 2]), "expected a JSON object"),
        (json.dumps({"messages": [{"role": "robot", "content": "a"}]}), "unknown role 'robot'"),
        (json.dumps({"messages": [{"role": "user", "content": "a"}]}), "no assistant message"),
        (json.dumps({"messages": [{"role": "user"}]}), 'string "role" and "content"'),
        (json.dumps({"prompt": 1, "completion": "a"}), "must be strings"),
        (b'{"prompt": "caf\xe9", "completion": "a"}', "not valid UTF-8"),
    ],
)
def test_bad_line_names_file_and_line(tok, tmp_path, line, needle):
    msg = _error(tmp_path, tok, [GOOD, "", line, GOOD])
    assert msg.startswith(f"{tmp_path / 'bad.jsonl'}:3: "), msg
    assert needle in msg


def test_too_long_is_refused(tok, tmp_path):
    long = json.dumps({"prompt": "what is 2+2=" * 10, "completion": "4"})
    msg = _error(tmp_path, tok, [GOOD, long], seq_len=16)
    assert msg.startswith(f"{tmp_path / 'bad.jsonl'}:2: ") and "longer than --seq-len 16" in msg


def test_messages_need_a_chat_template(tmp_path):
    tok = _tokenizer(chat_template=None)
    chat = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    msg = _error(tmp_path, tok, [GOOD, chat])
    assert msg.startswith(f"{tmp_path / 'bad.jsonl'}:2: ") and "no chat template" in msg


def test_cli_reports_bad_data_before_training(tok, tmp_path, capsys):
    model = tmp_path / "model"
    tok.save_pretrained(model)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))  # the CLI checks that it is a model
    bad = _write(tmp_path / "train.jsonl", [GOOD, "{oops"])
    assert main(["--model", str(model), "--data", bad, "--devices", "1"]) == 2
    assert f"{bad}:2: invalid JSON" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--data", "x.jsonl"],
        ["--export", "out"],
        ["--val-data", "v.jsonl"],
        ["--model", "m", "--data", "x", "--seq-len", "1"],
    ],
)
def test_cli_flag_combinations(argv):
    with pytest.raises(SystemExit):
        main(argv)


@pytest.mark.parametrize("n, world", [(5, 2), (4, 2), (1, 3)])
def test_eval_shards_score_each_example_once(tok, tmp_path, n, world):
    from slidedp_lightning.recipes.data import EvalShard
    from slidedp_lightning.recipes.own_data import sum_metrics

    data = JsonlDataset(_write(tmp_path / "v.jsonl", [GOOD] * n), tok, seq_len=16)
    shards = [EvalShard(data, r, world) for r in range(world)]
    assert len({len(s) for s in shards}) == 1  # same number of batches on every rank
    real = sorted(i for s in shards for i in s.indices if i >= 0)
    assert real == list(range(n))
    # blank rows add nothing to the sums; real rows add their loss tokens
    vocab = len(tok)
    total = torch.zeros(5, dtype=torch.float64)
    for s in shards:
        labels = torch.stack([s[i]["labels"] for i in range(len(s))])
        total += sum_metrics(torch.zeros(labels.shape[0], 16, vocab), labels)
    tokens = int((data.labels[:, 1:] != IGNORE_INDEX).sum())
    assert total[2] == tokens and total[4] == n
    assert total[0].item() == pytest.approx(tokens * math.log(vocab))


def test_a_validation_split_holds_out_a_seeded_fraction(tok, tmp_path):
    lines = [json.dumps({"prompt": f"what is {i}+{i}=", "completion": str(2 * i)}) for i in range(10)]
    data = JsonlDataset(_write(tmp_path / "d.jsonl", lines), tok, seq_len=24)
    train, val = data.split(0.3, seed=7)
    assert (len(train), len(val)) == (7, 3)

    def rows(part):
        return {tuple(part[i]["input_ids"].tolist()) for i in range(len(part))}

    assert rows(train) | rows(val) == rows(data) and not rows(train) & rows(val)
    again_train, again_val = data.split(0.3, seed=7)
    assert rows(again_val) == rows(val)  # the same seed on every rank: the same split
    assert len({frozenset(rows(data.split(0.3, seed=s)[1])) for s in range(6)}) > 1  # the seed chooses it
    assert val[-1]["labels"].eq(IGNORE_INDEX).all()  # a padding row of an evaluation shard, as for a whole file
    with pytest.raises(ValueError, match="leaves none of the 10 examples for training"):
        data.split(0.99, seed=7)


def test_truncate_cuts_long_examples_and_leaves_out_those_without_a_loss_token(tok, tmp_path):
    long_answer = json.dumps({"prompt": "what is 2+2=", "completion": "4" * 40})  # keeps answer tokens when cut
    long_prompt = json.dumps({"prompt": "what is 2+2=" * 10, "completion": "4"})  # its answer is cut off
    path = _write(tmp_path / "d.jsonl", [GOOD, long_answer, long_prompt])
    data = JsonlDataset(path, tok, seq_len=16, truncate=True)
    assert (len(data), data.truncated, data.dropped) == (2, 2, 1)
    whole = JsonlDataset(_write(tmp_path / "w.jsonl", [long_answer]), tok, seq_len=128)
    assert int(data.attention_mask[1].sum()) == 16
    assert torch.equal(data.input_ids[1], whole.input_ids[0, :16]) and torch.equal(data.labels[1], whole.labels[0, :16])
    with pytest.raises(DataError, match="no example keeps a loss token within its first 16 tokens"):
        JsonlDataset(_write(tmp_path / "p.jsonl", [long_prompt]), tok, seq_len=16, truncate=True)
    assert "--truncate to cut" in _error(tmp_path, tok, [long_prompt], seq_len=16)


ROWS = [
    {"prompt": "what is 2+2=", "completion": "4"},
    {"messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "ant"}]},
    {"prompt": "what is 2+", "completion": "2=4"},
]


def _saved(tmp_path, kind: str) -> str:
    """ROWS as a local file (or directory) of ``kind``, written with Hugging Face datasets."""
    import datasets

    table = datasets.Dataset.from_dict({k: [r.get(k) for r in ROWS] for k in ("prompt", "completion", "messages")})
    if kind == "json":  # one JSON array
        path = tmp_path / "d.json"
        path.write_text(json.dumps(ROWS))
    elif kind == "parquet":
        path = tmp_path / "d.parquet"
        table.to_parquet(str(path))
    else:
        table.save_to_disk(str(tmp_path / "saved"))
        if kind == "dict":
            datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "dict"))
            return str(tmp_path / "dict")
        if kind == "saved":
            return str(tmp_path / "saved")
        (path,) = (tmp_path / "saved").glob("*.arrow")
    return str(path)


@pytest.mark.parametrize("kind", ["json", "parquet", "arrow", "saved", "dict"])
def test_datasets_files_give_the_rows_of_the_same_jsonl(tok, tmp_path, kind):
    pytest.importorskip("datasets")
    jsonl = JsonlDataset(_write(tmp_path / "d.jsonl", [json.dumps(r) for r in ROWS]), tok, seq_len=32)
    other = JsonlDataset(_saved(tmp_path, kind), tok, seq_len=32)
    for name in ("input_ids", "labels", "attention_mask"):
        assert torch.equal(getattr(other, name), getattr(jsonl, name)), name


def test_a_bad_datasets_row_names_the_file_and_row(tok, tmp_path):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "bad.parquet"
    datasets.Dataset.from_list([{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": None}]).to_parquet(
        str(path)
    )
    with pytest.raises(DataError, match=f"^{path}:2: record has neither schema"):
        JsonlDataset(str(path), tok, seq_len=32)
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="Hugging Face datasets cannot read it"):
        JsonlDataset(str(tmp_path / "broken.parquet"), tok, seq_len=32)
