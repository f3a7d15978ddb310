"""Synthetic sequence task used by the fine-tuning recipe.

The task is generated locally from a seed (no download).  Each example is::

    [BOS] x_1 x_2 ... x_k [SEP] y_1 y_2 ... y_k

where ``x`` are ``k`` symbols drawn uniformly at random and ``y`` is ``x``
transformed by the task (``reverse``: ``y = x[::-1]``; ``sort``: ``y =
sorted(x)``; ``copy``: ``y = x``).  The prompt (``[BOS] x [SEP]``) is masked
out of the loss with ``-100`` labels, so loss and accuracy count only the
answer tokens ``y``.

Token ids are ``0 .. vocab_size - 1``: four special tokens followed by the
symbols.  When fine-tuning a pre-trained checkpoint the task simply uses the
first ``vocab_size`` token ids of that model's vocabulary.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from slidedp_lightning.recipes.settings import (  # noqa: F401  (the task's shape and ids, re-exported)
    BOS_ID,
    EOS_ID,
    IGNORE_INDEX,
    NUM_SPECIAL_TOKENS,
    PAD_ID,
    SEP_ID,
    TASKS,
    TaskSpec,
)


def generate(spec: TaskSpec, num_examples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(input_ids, labels)``, both ``int64`` of shape ``(num_examples, spec.seq_len)``.

    The result depends only on ``(spec, num_examples, seed)``; the first ``n``
    rows are the same for any ``num_examples >= n``.
    """
    if num_examples < 0:
        raise ValueError(f"num_examples must be >= 0, got {num_examples}")
    gen = torch.Generator().manual_seed(int(seed))
    k = spec.length
    x = torch.randint(0, spec.num_symbols, (num_examples, k), generator=gen, dtype=torch.int64)
    x = x + NUM_SPECIAL_TOKENS
    if spec.task == "reverse":
        y = x.flip(1)
    elif spec.task == "sort":
        y = x.sort(dim=1).values
    else:  # copy
        y = x.clone()
    bos = torch.full((num_examples, 1), BOS_ID, dtype=torch.int64)
    sep = torch.full((num_examples, 1), SEP_ID, dtype=torch.int64)
    input_ids = torch.cat([bos, x, sep, y], dim=1)
    labels = input_ids.clone()
    labels[:, : spec.prompt_len] = IGNORE_INDEX
    return input_ids, labels


class SyntheticTaskDataset(Dataset):
    """Fixed-size, seed-deterministic dataset of task examples.

    Items are dicts with ``input_ids``, ``labels`` and ``attention_mask``
    (all ``int64`` tensors of length ``spec.seq_len``), the format expected by
    Hugging Face causal-LM models (which shift ``labels`` internally).
    """

    def __init__(self, spec: TaskSpec, size: int, seed: int) -> None:
        self.spec = spec
        self.seed = int(seed)
        self.input_ids, self.labels = generate(spec, size, seed)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        ids = self.input_ids[idx]
        return {
            "input_ids": ids,
            "labels": self.labels[idx],
            "attention_mask": torch.ones_like(ids),
        }


def answer_accuracy_counts(
    logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy next-token accuracy on answer tokens.

    ``logits`` is ``(batch, seq, vocab)`` as returned by a causal LM for the
    unshifted ``input_ids``; ``labels`` is ``(batch, seq)`` with ``-100`` on
    ignored positions.  The prediction at position ``t`` is scored against
    ``labels[t + 1]``.

    Returns ``(correct_tokens, answer_tokens, exact_sequences)`` as int64
    scalars, where ``exact_sequences`` counts rows whose every answer token is
    right (rows without answer tokens are not counted as exact).
    """
    if logits.shape[:2] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    pred = logits[:, :-1].argmax(dim=-1)
    target = labels[:, 1:]
    mask = target != IGNORE_INDEX
    hit = (pred == target) & mask
    correct = hit.sum()
    total = mask.sum()
    row_has_answer = mask.any(dim=1)
    exact = (((hit | ~mask).all(dim=1)) & row_has_answer).sum()
    return correct, total, exact


def answer_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of answer tokens predicted correctly (greedy, teacher-forced); NaN if none."""
    correct, total, _ = answer_accuracy_counts(logits, labels)
    if int(total) == 0:
        return float("nan")
    return float(correct) / float(total)
