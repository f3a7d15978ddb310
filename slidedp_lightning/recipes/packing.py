"""Packed rows (``slidedp-finetune --pack``): the examples of a :class:`~slidedp_lightning.recipes.data.JsonlDataset`
concatenated, in order, into rows of ``seq_len`` tokens, each example attending only to itself.

A row holds as many whole examples as fit (greedy, in the data's order; no example is split) and ends in padding.
Its ``position_ids`` restart at 0 with every example, and at the padding, and the row carries no attention mask:
transformers then reads the example boundaries from the position ids and builds a block-diagonal causal mask
(``masking_utils.find_packed_sequence_indices``), so an example's logits are those of the example alone in its
own row.  The first token of each example gets no label: in its own row it is never a target, here it would be the
target of the previous example's last token.  Each item also has ``num_tokens``, the row's tokens that are not
padding (the throughput counts those).
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from slidedp_lightning.recipes.data import JsonlDataset
from slidedp_lightning.recipes.synthetic import IGNORE_INDEX


def pack_rows(lengths: list[int], seq_len: int) -> list[list[int]]:
    """The examples (indices into ``lengths``) of each row: in order, a new row whenever the next example would not
    fit in the current one."""
    rows: list[list[int]] = []
    used = seq_len  # no open row yet
    for i, n in enumerate(lengths):
        if not 0 < n <= seq_len:
            raise ValueError(f"example {i} has {n} tokens; a row holds 1 to {seq_len}")
        if used + n > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


class PackedDataset(Dataset):
    """The examples of ``examples`` packed into rows of its ``seq_len`` (see the module docstring).

    Items have ``input_ids``, ``labels``, ``position_ids`` (int64, length ``seq_len``) and ``num_tokens``;
    :attr:`segments` lists each row's ``(example, start, length)``.
    """

    def __init__(self, examples: JsonlDataset) -> None:
        seq_len = examples.seq_len
        lengths = [int(n) for n in examples.attention_mask.sum(dim=1)]
        rows = pack_rows(lengths, seq_len)
        self.seq_len, self.examples = seq_len, len(lengths)
        self.input_ids = torch.full((len(rows), seq_len), examples.pad_id, dtype=torch.int64)
        self.labels = torch.full((len(rows), seq_len), IGNORE_INDEX, dtype=torch.int64)
        self.position_ids = torch.zeros((len(rows), seq_len), dtype=torch.int64)
        self.num_tokens = torch.zeros(len(rows), dtype=torch.int64)
        self.segments: list[list[tuple[int, int, int]]] = []
        for r, members in enumerate(rows):
            start, row = 0, []
            for i in members:
                n = lengths[i]
                self.input_ids[r, start : start + n] = examples.input_ids[i, :n]
                self.labels[r, start + 1 : start + n] = examples.labels[i, 1:n]
                self.position_ids[r, start : start + n] = torch.arange(n)
                row.append((i, start, n))
                start += n
            self.position_ids[r, start:] = torch.arange(seq_len - start)  # the padding: a run of its own
            self.num_tokens[r] = start
            self.segments.append(row)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def fill(self) -> float:
        """The share of the rows' tokens that are not padding."""
        return float(self.num_tokens.sum()) / max(1, self.input_ids.numel())

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids[idx],
            "labels": self.labels[idx],
            "position_ids": self.position_ids[idx],
            "num_tokens": self.num_tokens[idx],
        }
