"""models.structure on the shapes other libraries give their models: blocks in an nn.ModuleDict (torchtitan) and
weights read through plain attributes (torchtune's TiedLinear, closures, lists), streamed like torch's AdamW; a
read that no attribute shows is refused by name at the first training forward, never a storage error."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from slidedp_lightning.models import UnsupportedModelError, adapter_for, hidden_uses, stream_blocks
from slidedp_lightning.runtime.engine import EngineConfig, SlideDPEngine
from tests.helpers import VOCAB, Block, token_batches
from tests.models.helpers import adamw, train_and_compare

WIDTH = 32


class TiedHead:
    """A plain object holding the embedding module, as torchtune's ``TiedLinear``: the head reads its weight."""

    def __init__(self, tied_module: nn.Module) -> None:
        self.tied_module = tied_module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.tied_module.weight)


class Decoder(nn.Module):
    """torchtune/torchtitan's layout: ``tok_embeddings``, ``layers`` (a ModuleList or a ModuleDict), ``norm``,
    ``output``; ``head`` picks how the output projection reads the embedding."""

    def __init__(self, *, layers: int = 3, blocks: str = "list", head: str = "linear") -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, WIDTH)
        made = [Block(WIDTH, 2) for _ in range(layers)]
        self.layers: nn.Module = (
            nn.ModuleDict({str(i): b for i, b in enumerate(made)}) if blocks == "dict" else nn.ModuleList(made)
        )
        self.norm = nn.LayerNorm(WIDTH)
        embedding = self.tok_embeddings
        if head == "linear":
            self.output: object = nn.Linear(WIDTH, VOCAB, bias=False)
        elif head == "tied_object":
            self.output = TiedHead(embedding)
        elif head == "closure":
            self.output = lambda h: F.linear(h, embedding.weight)
        elif head == "partial":
            self.output = functools.partial(tied_linear, embedding)
        elif head == "list":
            self.output = [embedding]  # read below as self.output[0].weight
        elif head == "global":
            GLOBAL_EMBEDDING[:] = [embedding]  # nothing of the model shows the tie
            self.output = None
        self.head = head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers:
            h = layer(h)
        h = self.norm(h)
        if self.head == "list":
            return F.linear(h, self.output[0].weight)  # type: ignore[index]
        if self.head == "global":
            return F.linear(h, GLOBAL_EMBEDDING[0].weight)
        return self.output(h)  # type: ignore[operator]


GLOBAL_EMBEDDING: list[nn.Module] = []


def tied_linear(embedding: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return F.linear(h, embedding.weight)


def decoder(seed: int = 0, **kwargs) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(**kwargs)


def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())


def test_blocks_in_a_module_dict_are_found_and_stream_in_insertion_order() -> None:
    model = decoder(blocks="dict")
    specs = adapter_for(model).units(model)
    assert [s.name for s in specs] == ["embed", "layers.0", "layers.1", "layers.2", "head"]
    assert [s.modules[0] for s in specs[1:4]] == list(model.layers.values())
    train_and_compare(model, loss_fn, token_batches(3, 2, 12), steps=3)


def test_a_module_dict_can_be_named_with_stream_blocks() -> None:
    model = stream_blocks(decoder(blocks="dict"), "layers")
    assert [s.name for s in adapter_for(model).units(model)][1:4] == ["layers.0", "layers.1", "layers.2"]


@pytest.mark.parametrize("head", ["tied_object", "closure", "partial", "list"])
def test_a_weight_read_through_a_plain_attribute_is_found(head: str) -> None:
    model = decoder(head=head)
    uses = hidden_uses(model)
    assert len(uses) == 1 and uses[0].holder is model and uses[0].params == (model.tok_embeddings.weight,)
    assert "output" in uses[0].where


@pytest.mark.parametrize("head", ["tied_object", "partial", "list"])
def test_a_weight_read_through_a_plain_attribute_streams_with_its_unit(head: str) -> None:
    """torchtune's TiedLinear, a partial and a list attribute: each reads the embedding from the decoder's own
    forward, outside every unit; the embedding unit stays resident around that forward and for its backward, and
    training equals torch's AdamW step by step. (A lambda is found the same way, but the reference's deep copy
    would share it, and with it the streamed model's embedding.)"""
    train_and_compare(decoder(head=head), loss_fn, token_batches(3, 2, 12), steps=3)


def test_the_tree_shows_ties_it_holds_registered() -> None:
    assert hidden_uses(decoder(head="linear")) == []


@pytest.mark.parametrize("unit_copies", ["always", "never"])  # "never": the read would succeed in the ledger
def test_a_read_no_attribute_shows_is_refused_by_name_at_the_first_forward(unit_copies: str) -> None:
    model = decoder(head="global")
    assert hidden_uses(model) == []
    config = EngineConfig(unit_copies=unit_copies)
    engine = SlideDPEngine(model, config, device=torch.device("cpu"), compute_dtype=torch.float32)
    try:
        engine.attach_optimizer(adamw(model))
        x = token_batches(1, 2, 12)[0]
        with pytest.raises(UnsupportedModelError, match=r"tok_embeddings\.weight while its unit 'embed'"):
            loss_fn(model, x)
    finally:
        engine.close()


class TwoStack(nn.Module):
    """Blocks in two lists, neither holding most parameters: the automatic split refuses it as ambiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.lower = nn.ModuleList(Block(WIDTH, 2) for _ in range(2))
        self.upper = nn.ModuleList(Block(WIDTH, 2) for _ in range(2))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in (*self.lower, *self.upper):
            h = block(h)
        return self.head(self.norm(h))


def test_the_readme_adapter_example_streams_a_model_the_automatic_split_refuses() -> None:
    from slidedp_lightning.models import adapter as adapter_module

    readme = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    block = readme.split("<!-- register-adapter-example", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    torch.manual_seed(0)
    model = TwoStack()
    with pytest.raises(UnsupportedModelError, match="ambiguous"):
        adapter_for(model)
    before = list(adapter_module._ADAPTERS)
    namespace: dict = {}
    exec(compile(block, "docs/models.md", "exec"), namespace)
    try:
        assert isinstance(adapter_for(model), namespace["TwoStackAdapter"])
        assert [s.name for s in adapter_for(model).units(model)] == [
            "embed",
            "layers.0",
            "layers.1",
            "layers.2",
            "layers.3",
            "head",
        ]
        train_and_compare(model, loss_fn, token_batches(3, 2, 12), steps=3)
    finally:
        adapter_module._ADAPTERS[:] = before
