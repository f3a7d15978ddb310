"""models.hf_decoder / models.adapter: which models SlideDP streams, and that the Qwen/Llama/Mistral families train
exactly (every other family: tests/models/test_adapters.py)."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from slidedp_lightning.models import (
    HFDecoderAdapter,
    UnitSpec,
    UnsupportedModelError,
    adapter_for,
    hf_decoder,
    register_adapter,
)
from slidedp_lightning.models import adapter as adapter_module
from slidedp_lightning.runtime.engine import EngineConfig, SlideDPEngine
from tests.helpers import VOCAB, tiny_config, token_batches
from tests.models.helpers import lm_loss, train_and_compare

FAMILIES = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
}


class ToyLMWithoutBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.out = nn.Linear(32, VOCAB)


def tiny(family: str, tied: bool, layers: int = 2, seed: int = 0) -> nn.Module:
    config_cls, model_cls = FAMILIES[family]
    cfg = tiny_config(tied, layers, family=config_cls)
    torch.manual_seed(seed)
    return model_cls(cfg)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_adapter_matches_supported_families(family: str) -> None:
    for tied in (True, False):
        model = tiny(family, tied)
        assert model.config.model_type == family
        adapter = adapter_for(model)
        assert isinstance(adapter, HFDecoderAdapter)
        units = adapter.units(model)
        assert [u.name for u in units] == ["embed", "layers.0", "layers.1", "head"]
        assert units[0].modules == (model.model.embed_tokens,)
        assert units[1].modules == (model.model.layers[0],)
        assert units[-1].modules == (model.model.norm, model.lm_head)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_like_adamw(family: str, tied: bool) -> None:
    model = tiny(family, tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    train_and_compare(model, lm_loss, token_batches(2, batch=2, seq=12))


def test_no_model_type_list() -> None:
    """The adapter is found from the model's structure: no list of model types names what it accepts."""
    assert "SUPPORTED_MODEL_TYPES" not in vars(hf_decoder)
    assert "structure" in HFDecoderAdapter.name


@pytest.mark.parametrize(
    "make", [lambda: nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8)), ToyLMWithoutBlocks], ids=["sequential", "toy"]
)
def test_unsupported_model_says_how_to_stream_it(make) -> None:
    model = make()
    with pytest.raises(UnsupportedModelError) as info:
        adapter_for(model)
    msg = str(info.value)
    assert f"found no block list in {type(model).__name__}" in msg
    assert "slidedp_lightning.stream_blocks(model, " in msg
    assert "register_adapter" in msg


def test_unsupported_model_rejected_by_engine_naming_the_adapters() -> None:
    with pytest.raises(UnsupportedModelError, match="no block list in ToyLMWithoutBlocks") as info:
        SlideDPEngine(ToyLMWithoutBlocks(), EngineConfig(), device=torch.device("cpu"), compute_dtype=torch.float32)
    assert HFDecoderAdapter.name in str(info.value)


def test_structure_not_class_decides() -> None:
    """A bare base model (no lm_head) or one whose head is replaced streams just the same: the layers and the
    modules around them are found from the structure."""
    model = tiny("llama", tied=False)
    base = model.model
    assert HFDecoderAdapter.matches(base)
    units = HFDecoderAdapter().units(base)
    assert [u.name for u in units] == ["embed", "layers.0", "layers.1", "head"]
    assert units[-1].modules == (base.norm,)
    model.lm_head = nn.Identity()
    assert HFDecoderAdapter().units(model)[-1].modules == (base.norm,)


def test_model_without_layers_rejected() -> None:
    model = tiny("qwen3", tied=False)
    model.model.layers = nn.ModuleList()
    with pytest.raises(UnsupportedModelError, match="no block list in Qwen3ForCausalLM"):
        HFDecoderAdapter().units(model)


def test_unknown_meta_buffer_rejected() -> None:
    with torch.device("meta"):
        model = tiny("qwen3", tied=True)
    model.model.norm.register_buffer("scale_cache", torch.empty(3, device="meta"), persistent=False)
    with pytest.raises(UnsupportedModelError, match="scale_cache"):
        HFDecoderAdapter().materialize_buffers(model)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_materialize_rotary_buffers(family: str) -> None:
    with torch.device("meta"):
        model = tiny(family, tied=True)
    HFDecoderAdapter().materialize_buffers(model)
    ref = tiny(family, tied=True)
    buffers, ref_buffers = dict(model.named_buffers()), dict(ref.named_buffers())
    assert buffers.keys() == ref_buffers.keys() and buffers
    for name, buf in ref_buffers.items():
        assert torch.equal(buffers[name], buf), name


# -- a registered third-party adapter -----------------------------------------------------------------------


class ToyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(32, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


class ToyAdapter:
    name = "toy LM"

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return isinstance(model, ToyLM)

    def units(self, model: ToyLM) -> list[UnitSpec]:
        return (
            [UnitSpec("embed", (model.embed,))]
            + [UnitSpec(f"blocks.{i}", (b,)) for i, b in enumerate(model.blocks)]
            + [UnitSpec("out", (model.out,))]
        )

    def init_weights(self, model: nn.Module, module: nn.Module) -> None:
        for sub in module.modules():
            if hasattr(sub, "reset_parameters"):
                sub.reset_parameters()

    def materialize_buffers(self, model: nn.Module) -> None:
        pass


@pytest.fixture
def toy_adapter():
    register_adapter(ToyAdapter)
    try:
        yield ToyAdapter
    finally:
        adapter_module._ADAPTERS.remove(ToyAdapter)


def test_registered_adapter_is_found_and_trains(toy_adapter) -> None:
    torch.manual_seed(0)
    model = ToyLM()
    assert isinstance(adapter_for(model), ToyAdapter)

    def loss_fn(m, x):
        return nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten())

    train_and_compare(model, loss_fn, token_batches(3, batch=2, seq=12), steps=3)


def test_unregistered_adapter_is_not_found() -> None:
    with pytest.raises(UnsupportedModelError, match="ToyLM"):
        adapter_for(ToyLM())
