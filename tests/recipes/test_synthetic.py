"""Unit tests of the synthetic task used by the fine-tuning recipe (fast, CPU only)."""

import math

import pytest
import torch

from slidedp_lightning.recipes.synthetic import (
    BOS_ID,
    IGNORE_INDEX,
    NUM_SPECIAL_TOKENS,
    SEP_ID,
    SyntheticTaskDataset,
    TaskSpec,
    answer_accuracy,
    answer_accuracy_counts,
    generate,
)


@pytest.mark.parametrize("task", ["reverse", "sort", "copy"])
def test_deterministic_by_seed(task):
    spec = TaskSpec(task=task, num_symbols=10, length=5)
    a_ids, a_lab = generate(spec, 64, seed=3)
    b_ids, b_lab = generate(spec, 64, seed=3)
    c_ids, _ = generate(spec, 64, seed=4)
    assert torch.equal(a_ids, b_ids) and torch.equal(a_lab, b_lab)
    assert not torch.equal(a_ids, c_ids)
    # A longer set from the same seed starts with the shorter one.
    d_ids, d_lab = generate(spec, 100, seed=3)
    assert torch.equal(d_ids[:64], a_ids) and torch.equal(d_lab[:64], a_lab)


def test_independent_of_global_rng():
    spec = TaskSpec()
    torch.manual_seed(0)
    a, _ = generate(spec, 8, seed=1)
    torch.manual_seed(123)
    torch.rand(10)
    b, _ = generate(spec, 8, seed=1)
    assert torch.equal(a, b)


def test_shapes_dtypes_and_vocab():
    spec = TaskSpec(task="reverse", num_symbols=60, length=12)
    assert spec.vocab_size == NUM_SPECIAL_TOKENS + 60
    assert spec.seq_len == 26 and spec.prompt_len == 14
    ds = SyntheticTaskDataset(spec, size=33, seed=0)
    assert len(ds) == 33
    item = ds[5]
    assert set(item) == {"input_ids", "labels", "attention_mask"}
    for v in item.values():
        assert v.shape == (spec.seq_len,) and v.dtype == torch.int64
    assert torch.all(item["attention_mask"] == 1)
    assert ds.input_ids.min() >= 0 and ds.input_ids.max() < spec.vocab_size
    batch = torch.utils.data.default_collate([ds[i] for i in range(4)])
    assert batch["input_ids"].shape == (4, spec.seq_len)


@pytest.mark.parametrize("task", ["reverse", "sort", "copy"])
def test_layout_and_answer_mask(task):
    spec = TaskSpec(task=task, num_symbols=7, length=6)
    ids, labels = generate(spec, 50, seed=11)
    k = spec.length
    assert torch.all(ids[:, 0] == BOS_ID)
    assert torch.all(ids[:, k + 1] == SEP_ID)
    x, y = ids[:, 1 : k + 1], ids[:, k + 2 :]
    assert torch.all(x >= NUM_SPECIAL_TOKENS) and torch.all(y >= NUM_SPECIAL_TOKENS)
    expected = {"reverse": x.flip(1), "sort": x.sort(dim=1).values, "copy": x}[task]
    assert torch.equal(y, expected)
    # Prompt (BOS, symbols, SEP) is masked; every answer token is a label.
    assert torch.all(labels[:, : spec.prompt_len] == IGNORE_INDEX)
    assert torch.equal(labels[:, spec.prompt_len :], y)
    assert int((labels != IGNORE_INDEX).sum()) == 50 * k


def _perfect_logits(ids, vocab):
    """Logits whose argmax at position t is ids[t + 1] (a perfect causal LM)."""
    logits = torch.full((*ids.shape, vocab), -1.0)
    nxt = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    logits.scatter_(2, nxt.unsqueeze(-1), 1.0)
    return logits


def test_accuracy_metric():
    spec = TaskSpec(task="reverse", num_symbols=9, length=4)
    ids, labels = generate(spec, 6, seed=0)
    logits = _perfect_logits(ids, spec.vocab_size)
    assert answer_accuracy(logits, labels) == 1.0
    correct, total, exact = answer_accuracy_counts(logits, labels)
    assert (int(correct), int(total), int(exact)) == (24, 24, 6)

    # Wrong predictions on prompt positions do not count.
    bad_prompt = logits.clone()
    bad_prompt[:, : spec.prompt_len - 1] = torch.flip(bad_prompt[:, : spec.prompt_len - 1], dims=[-1])
    assert answer_accuracy(bad_prompt, labels) == 1.0

    # Break exactly one answer token in row 0 (predicted at position prompt_len - 1).
    broken = logits.clone()
    t = spec.prompt_len - 1
    target = int(ids[0, t + 1])
    broken[0, t] = 0.0
    broken[0, t, (target + 1) % spec.vocab_size] = 5.0
    correct, total, exact = answer_accuracy_counts(broken, labels)
    assert (int(correct), int(total), int(exact)) == (23, 24, 5)
    assert answer_accuracy(broken, labels) == pytest.approx(23 / 24)


def test_accuracy_edge_cases():
    labels = torch.full((2, 5), IGNORE_INDEX)
    logits = torch.zeros(2, 5, 8)
    assert math.isnan(answer_accuracy(logits, labels))
    assert int(answer_accuracy_counts(logits, labels)[2]) == 0
    with pytest.raises(ValueError):
        answer_accuracy(torch.zeros(2, 4, 8), labels)


def test_random_guess_accuracy_is_low():
    spec = TaskSpec(task="reverse", num_symbols=60, length=12)
    ids, labels = generate(spec, 256, seed=5)
    logits = torch.randn(*ids.shape, spec.vocab_size, generator=torch.Generator().manual_seed(0))
    assert answer_accuracy(logits, labels) < 0.05


def test_invalid_spec():
    with pytest.raises(ValueError):
        TaskSpec(task="nope")
    with pytest.raises(ValueError):
        TaskSpec(num_symbols=1)
    with pytest.raises(ValueError):
        TaskSpec(length=0)
    with pytest.raises(ValueError):
        generate(TaskSpec(), -1, seed=0)


def test_default_task_fits_shipped_config():
    import json
    from importlib import resources

    text = resources.files("slidedp_lightning.recipes").joinpath("configs", "qwen3_tiny.json").read_text()
    cfg = json.loads(text)
    spec = TaskSpec()
    assert cfg["model_type"] == "qwen3"
    assert cfg["vocab_size"] >= spec.vocab_size
    assert cfg["max_position_embeddings"] >= spec.seq_len
