"""Fine-tuning data for ``slidedp-finetune --data``: reading, checking, tokenizing, padding.

A JSONL file is read here, line by line; a local ``.json``, ``.parquet`` or ``.arrow`` file, or a directory that
``datasets``' ``save_to_disk`` wrote, through Hugging Face ``datasets`` (offline: local files only), each row a
record. Each line (row) is one JSON object in one of two schemas:

* ``{"prompt": str, "completion": str}``: the prompt and the completion are tokenized separately (no special
  tokens added) and concatenated, then the tokenizer's EOS token is appended; the loss covers the completion tokens
  and that EOS.
* ``{"messages": [{"role": str, "content": str}, ...]}``: the tokenizer's chat template renders the conversation.
  Assistant spans are found by rendering it prefix by prefix: for assistant message ``i`` the span runs from the end
  of ``render(messages[:i], add_generation_prompt=True)`` to the end of ``render(messages[:i + 1])`` (its content and
  the template's end-of-turn text).  Every rendered prefix must be a string prefix of the whole conversation (true of
  ChatML-style templates; a template that rewrites earlier turns is refused).  The text is then tokenized segment by
  segment (template text, assistant span, ...), so the label mask is exact by construction whatever the tokenizer
  merges, and each prompt is tokenized exactly as at generation time (prompt rendered, then generated tokens).
  This works with any template; ``return_assistant_tokens_mask`` would need a ``{% generation %}`` block.

Labels are ``-100`` outside the loss tokens.  Every example is its own row, right-padded to ``seq_len`` with an
attention mask of zeros on the padding (:mod:`~slidedp_lightning.recipes.packing` packs them into full rows instead).
An example longer than ``seq_len`` is refused, or with ``truncate`` cut to its first ``seq_len`` tokens (one whose
loss tokens all fall beyond them is left out; both are counted).  Every problem raises :class:`DataError` naming the
file and line, before any training starts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from slidedp_lightning.recipes.settings import DATASET_BUILDERS, is_saved_dataset
from slidedp_lightning.recipes.synthetic import IGNORE_INDEX

ROLES = ("system", "user", "assistant", "tool")


class DataError(ValueError):
    """A data file problem, with the file and (1-based) line it was found at."""

    def __init__(self, path: str, line: int | None, message: str) -> None:
        self.path, self.line = path, line
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class Record:
    """One parsed line: exactly one of ``prompt``/``completion`` or ``messages`` is set."""

    path: str
    line: int
    prompt: str | None = None
    completion: str | None = None
    messages: tuple[dict[str, str], ...] | None = None


def _check_record(path: str, line: int, obj: Any) -> Record:
    if not isinstance(obj, dict):
        raise DataError(path, line, f"expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(path, line, '"messages" must be a non-empty list of {"role", "content"} objects')
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DataError(path, line, f'message {i} must be an object with string "role" and "content"')
            if m["role"] not in ROLES:
                raise DataError(path, line, f"message {i} has unknown role {m['role']!r}; expected one of {ROLES}")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(path, line, "no assistant message: nothing to train on")
        return Record(path, line, messages=tuple({"role": m["role"], "content": m["content"]} for m in messages))
    if "prompt" in obj and "completion" in obj:
        prompt, completion = obj["prompt"], obj["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise DataError(path, line, '"prompt" and "completion" must be strings')
        return Record(path, line, prompt=prompt, completion=completion)
    raise DataError(
        path,
        line,
        f'record has neither schema (keys {sorted(obj)}): expected {{"prompt", "completion"}} or {{"messages"}}',
    )


def read_jsonl(path: str) -> list[Record]:
    """Parse and check every line of ``path`` (blank lines are skipped); raise :class:`DataError` on any problem."""
    if os.path.isdir(path):
        raise DataError(path, None, "is a directory: pass a JSONL file (one example a line), not a folder")
    if not os.path.isfile(path):
        raise DataError(path, None, "no such file")
    with open(path, "rb") as f:
        raw_lines = f.read().split(b"\n")
    records = []
    for n, raw in enumerate(raw_lines, start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(path, n, f"not valid UTF-8 (byte {err.start} of the line)") from None
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(path, n, f"invalid JSON: {err.msg} (column {err.colno})") from None
        records.append(_check_record(path, n, obj))
    if not records:
        raise DataError(path, None, "empty file: no records")
    return records


def read_records(path: str) -> list[Record]:
    """The checked records of ``path``: a JSONL file (:func:`read_jsonl`), or what Hugging Face ``datasets`` reads
    offline from a local ``.json``, ``.parquet`` or ``.arrow`` file or a ``save_to_disk`` directory (its ``train``
    split for a ``DatasetDict``), row ``n`` named as line ``n``."""
    builder = DATASET_BUILDERS.get(os.path.splitext(path)[1].lower())
    saved = os.path.isdir(path) and is_saved_dataset(path)
    if builder is None and not saved:  # JSONL
        return read_jsonl(path)
    if not os.path.exists(path):
        raise DataError(path, None, "no such file")
    try:
        import datasets
    except ImportError:
        raise DataError(path, None, "reading it needs Hugging Face datasets: pip install datasets") from None
    try:
        if saved:
            table: Any = datasets.load_from_disk(path)
            if isinstance(table, datasets.DatasetDict):
                if "train" not in table:
                    raise DataError(path, None, f"a DatasetDict without a train split (splits: {sorted(table)})")
                table = table["train"]
        else:
            table = datasets.load_dataset(builder, data_files=path, split="train")
    except (ValueError, OSError, datasets.exceptions.DatasetGenerationError) as err:
        raise DataError(path, None, f"Hugging Face datasets cannot read it: {' '.join(str(err).split())}") from None
    # a column the row's schema does not use is None there (a table has every column in every row)
    records = [
        _check_record(path, n, {k: v for k, v in row.items() if v is not None}) for n, row in enumerate(table, 1)
    ]
    if not records:
        raise DataError(path, None, "empty: no records")
    return records


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _render(tokenizer: Any, messages: Sequence[dict[str, str]], generation_prompt: bool = False) -> str:
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)
    return str(text)


def encode(tokenizer: Any, record: Record) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one record (see the module docstring for the mask rule)."""
    if record.messages is None:
        assert record.prompt is not None and record.completion is not None
        prompt = _ids(tokenizer, record.prompt)
        answer = _ids(tokenizer, record.completion)
        if tokenizer.eos_token_id is not None:
            answer.append(int(tokenizer.eos_token_id))
        if not answer:
            raise DataError(record.path, record.line, "empty completion and no EOS token: nothing to train on")
        return prompt + answer, [IGNORE_INDEX] * len(prompt) + answer
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(record.path, record.line, "messages record but the tokenizer has no chat template")
    messages = record.messages
    full = _render(tokenizer, messages)
    cuts = [0]  # character offsets alternating template text / assistant span
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end = _render(tokenizer, messages[:i], True) if i else "", _render(tokenizer, messages[: i + 1])
        for prefix in (start, end):
            if not full.startswith(prefix) or len(prefix) < cuts[-1]:
                raise DataError(
                    record.path,
                    record.line,
                    f"the chat template does not render message {i}'s prefix as a prefix of the conversation; "
                    "assistant spans cannot be located",
                )
        cuts += [len(start), len(end)]
    cuts.append(len(full))
    input_ids: list[int] = []
    labels: list[int] = []
    for k in range(len(cuts) - 1):
        ids = _ids(tokenizer, full[cuts[k] : cuts[k + 1]])
        input_ids += ids
        labels += ids if k % 2 == 1 else [IGNORE_INDEX] * len(ids)
    if all(t == IGNORE_INDEX for t in labels):
        raise DataError(record.path, record.line, "the assistant messages render to no tokens")
    return input_ids, labels


class JsonlDataset(Dataset):
    """Tokenized examples of one or more JSONL files, each a row right-padded to ``seq_len``.

    Items have ``input_ids``, ``labels``, ``attention_mask`` (int64, length ``seq_len``).  With ``truncate`` a longer
    example keeps its first ``seq_len`` tokens; :attr:`truncated` and :attr:`dropped` count those cut and those
    left out (no loss token left).
    """

    truncated = 0
    dropped = 0

    def __init__(self, paths: str | Sequence[str], tokenizer: Any, seq_len: int, truncate: bool = False) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        self.seq_len = seq_len
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0
        rows: list[tuple[list[int], list[int]]] = []
        files = [paths] if isinstance(paths, str) else list(paths)
        for path in files:
            for record in read_records(path):
                ids, labels = encode(tokenizer, record)
                if len(ids) > seq_len:
                    if not truncate:
                        raise DataError(
                            path,
                            record.line,
                            f"example is {len(ids)} tokens, longer than --seq-len {seq_len} (raise --seq-len, or "
                            "--truncate to cut such examples to their first --seq-len tokens)",
                        )
                    ids, labels = ids[:seq_len], labels[:seq_len]
                    self.truncated += 1
                    if all(t == IGNORE_INDEX for t in labels[1:]):  # the first token is never a target
                        self.dropped += 1
                        continue
                rows.append((ids, labels))
        if not rows:
            raise DataError(", ".join(files), None, f"no example keeps a loss token within its first {seq_len} tokens")
        n = len(rows)
        self.input_ids = torch.full((n, seq_len), self.pad_id, dtype=torch.int64)
        self.labels = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.int64)
        self.attention_mask = torch.zeros((n, seq_len), dtype=torch.int64)
        for i, (ids, labels) in enumerate(rows):
            self.input_ids[i, : len(ids)] = torch.tensor(ids)
            self.labels[i, : len(ids)] = torch.tensor(labels)
            self.attention_mask[i, : len(ids)] = 1

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def split(self, fraction: float, seed: int) -> tuple[JsonlDataset, JsonlDataset]:
        """``(train, val)``: a seeded random ``fraction`` of the examples (at least one) held out for validation,
        the rest for training, each in file order."""
        n = len(self)
        held = max(1, round(n * fraction))
        if held >= n:
            raise ValueError(f"a validation split of {fraction:g} leaves none of the {n} examples for training")
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        val, train = order[:held].sort().values, order[held:].sort().values
        return self._rows(train), self._rows(val)

    def _rows(self, index: torch.Tensor) -> JsonlDataset:
        part = object.__new__(JsonlDataset)
        part.seq_len, part.pad_id = self.seq_len, self.pad_id
        part.truncated = part.dropped = 0
        part.input_ids, part.labels = self.input_ids[index], self.labels[index]
        part.attention_mask = self.attention_mask[index]
        return part

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if idx < 0:  # blank row padding a rank's evaluation shard: one token, no labels
            ids = torch.full((self.seq_len,), self.pad_id, dtype=torch.int64)
            mask = torch.zeros(self.seq_len, dtype=torch.int64)
            mask[0] = 1
            return {"input_ids": ids, "labels": torch.full_like(ids, IGNORE_INDEX), "attention_mask": mask}
        return {
            "input_ids": self.input_ids[idx],
            "labels": self.labels[idx],
            "attention_mask": self.attention_mask[idx],
        }


class EvalShard(Dataset):
    """Rank ``rank``'s share of ``dataset`` (items ``rank, rank + world, ...``), padded with blank rows to the same
    length on every rank: each example is scored exactly once and every rank runs the same number of batches."""

    def __init__(self, dataset: JsonlDataset, rank: int, world: int) -> None:
        self.dataset = dataset
        n = len(dataset)
        per_rank = -(-n // world)
        self.indices = [i if i < n else -1 for i in range(rank, per_rank * world, world)]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        return self.dataset[self.indices[idx]]
