"""--pack: rows filled greedily with whole examples; each example's loss in a packed row equals its loss alone in
its own row (FP32, every model type the job packs for, eager and SDPA attention, and through SlideDP's streamed
model), and a packed SlideDP fit equals plain AdamW on the same rows."""

from __future__ import annotations

import copy
import json

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from slidedp_lightning.recipes.data import JsonlDataset
from slidedp_lightning.recipes.packing import PackedDataset, pack_rows
from slidedp_lightning.recipes.settings import PACKING_MODEL_TYPES, pack_problem
from slidedp_lightning.recipes.synthetic import IGNORE_INDEX
from tests.helpers import family_config, tiny_model
from tests.recipes.test_data import _tokenizer, _write
from tests.trainers import adamw, quiet_and_clean, trainer  # noqa: F401  (the fixture)

SEQ = 40
VOCAB = 512  # the test tokenizer's 400 ids fit


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> JsonlDataset:
    tok = _tokenizer()
    lines = [json.dumps({"prompt": "what is " + "2+" * i + "2=", "completion": "4" * (1 + i % 3)}) for i in range(10)]
    chat = {"messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "ant"}]}
    path = _write(tmp_path_factory.mktemp("pack") / "d.jsonl", [*lines, json.dumps(chat)])
    return JsonlDataset(path, tok, SEQ)


def test_rows_are_filled_greedily_in_order():
    assert pack_rows([5, 9, 3, 12, 7, 20, 2, 4], 32) == [[0, 1, 2, 3], [4, 5, 6], [7]]
    assert pack_rows([32, 1, 31, 1], 32) == [[0], [1, 2], [3]]
    with pytest.raises(ValueError, match="example 1 has 33 tokens; a row holds 1 to 32"):
        pack_rows([3, 33], 32)


def test_a_packed_row_holds_each_example_whole(examples):
    packed = PackedDataset(examples)
    lengths = examples.attention_mask.sum(dim=1).tolist()
    assert len(packed) < len(examples) and packed.examples == len(examples)
    seen = []
    for r, segments in enumerate(packed.segments):
        item = packed[r]
        end = 0
        for i, start, n in segments:
            assert start == end and n == lengths[i]
            assert torch.equal(item["input_ids"][start : start + n], examples.input_ids[i, :n])
            assert torch.equal(item["position_ids"][start : start + n], torch.arange(n))
            assert item["labels"][start] == IGNORE_INDEX  # never the target of the previous example's last token
            assert torch.equal(item["labels"][start + 1 : start + n], examples.labels[i, 1:n])
            seen.append(i)
            end = start + n
        assert int(item["num_tokens"]) == end
        assert torch.equal(item["position_ids"][end:], torch.arange(SEQ - end))  # the padding: its own run
        assert item["labels"][end:].eq(IGNORE_INDEX).all() and item["input_ids"][end:].eq(examples.pad_id).all()
    assert seen == list(range(len(examples)))  # in order, each once
    assert packed.fill == pytest.approx(sum(lengths) / (len(packed) * SEQ))


def _example_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean loss over the label tokens of one example (``logits`` and ``labels`` of its own tokens)."""
    return F.cross_entropy(logits[:-1].double(), labels[1:], ignore_index=IGNORE_INDEX)


def per_example_losses(model, examples: JsonlDataset, packed: PackedDataset | None) -> list[float]:
    """Each example's loss: alone in its own padded row, or (``packed``) read off the packed rows."""
    with torch.no_grad():
        if packed is None:
            out = model(input_ids=examples.input_ids, attention_mask=examples.attention_mask, use_cache=False)
            lengths = examples.attention_mask.sum(dim=1).tolist()
            return [_example_losses(out.logits[i, :n], examples.labels[i, :n]).item() for i, n in enumerate(lengths)]
        out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
        losses = [0.0] * packed.examples
        for r, segments in enumerate(packed.segments):
            for i, start, n in segments:
                labels = packed.labels[r, start : start + n]
                losses[i] = _example_losses(out.logits[r, start : start + n], labels).item()
        return losses


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", [*PACKING_MODEL_TYPES, "gpt_oss"])
def test_a_packed_example_has_the_loss_it_has_alone(examples, model_type, attention):
    if model_type in ("gemma2", "gpt_oss") and attention == "sdpa":
        pytest.skip(f"transformers runs {model_type} on eager attention only (no SDPA)")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(model_type, vocab=VOCAB, max_positions=SEQ)).eval()
    model.set_attn_implementation(attention)
    want = per_example_losses(model, examples, None)
    got = per_example_losses(model, examples, PackedDataset(examples))
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    if model_type in PACKING_MODEL_TYPES:
        assert worst <= 1e-5, (model_type, attention, worst)
        assert pack_problem(model_type) is None
    else:  # why the job refuses it
        assert worst > 1e-2, (model_type, attention, worst)
        assert "drop --pack" in str(pack_problem(model_type))


class PackedLM(L.LightningModule):
    """A tiny Qwen3 trained on packed rows; records each step's batch and loss, and the per-example losses of the
    first (pre-update) forward."""

    def __init__(self, packed: PackedDataset) -> None:
        super().__init__()
        self.model = tiny_model(vocab=VOCAB, max_positions=SEQ)
        self.packed = packed
        self.losses: list[float] = []
        self.rows: list[torch.Tensor] = []
        self.first: list[float] | None = None

    def training_step(self, batch, batch_idx):
        self.rows.append(batch["row"])
        out = self.model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"], use_cache=False
        )
        if self.first is None:
            self.first = [0.0] * self.packed.examples
            for b, r in enumerate(batch["row"].tolist()):
                for i, start, n in self.packed.segments[r]:
                    labels = batch["labels"][b, start : start + n]
                    self.first[i] = _example_losses(out.logits[b, start : start + n].detach(), labels).item()
        self.losses.append(out.loss.item())
        return out.loss

    def configure_optimizers(self):
        return adamw(self.model.parameters())


class _Rows(torch.utils.data.Dataset):
    def __init__(self, packed: PackedDataset) -> None:
        self.packed = packed

    def __len__(self) -> int:
        return len(self.packed)

    def __getitem__(self, r: int) -> dict[str, torch.Tensor]:
        return self.packed[r] | {"row": torch.tensor(r)}


def test_slidedp_trains_packed_rows_as_plain_adamw(examples):
    """Through the streamed model: the first forward's per-example losses equal each example alone; three packed
    steps end with plain AdamW's losses and weights (FP32)."""
    packed = PackedDataset(examples)
    module = PackedLM(packed)
    ref = copy.deepcopy(module.model)
    want = per_example_losses(ref, examples, None)
    rows = DataLoader(_Rows(packed), batch_size=len(packed))  # every row in every step
    trainer(max_steps=3, use_distributed_sampler=False).fit(module, rows)

    assert module.first is not None
    assert max(abs(a - b) for a, b in zip(module.first, want, strict=True)) <= 1e-5
    ref_opt = adamw(ref.parameters())
    for step, batch_rows in enumerate(module.rows):
        batch = packed[batch_rows]
        ref_opt.zero_grad()
        loss = ref(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                   use_cache=False).loss  # fmt: skip
        loss.backward()
        ref_opt.step()
        assert abs(module.losses[step] - loss.item()) <= 1e-5 * abs(loss.item())
    ref_sd = ref.state_dict()
    for name, p in module.model.named_parameters():
        err = ((p.detach() - ref_sd[name]).abs().max() / ref_sd[name].abs().max()).item()
        assert err <= 1e-5, f"{name}: relative error {err:.3g}"
