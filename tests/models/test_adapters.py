"""The structural adapters: every transformers family of docs/models.md's table and nanoGPT-style user models stream
and train like torch's AdamW, meta init draws what the model's own init draws, and what cannot stream is refused."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

import slidedp_lightning
from slidedp_lightning.models import (
    BlockListAdapter,
    HFDecoderAdapter,
    UnsupportedModelError,
    adapter_for,
    find_streamed_model,
    stream_blocks,
)
from slidedp_lightning.runtime.activation_policy import ActivationPolicy
from slidedp_lightning.runtime.engine import EngineConfig, SlideDPEngine
from slidedp_lightning.runtime.layout import build_layout
from tests.helpers import (
    FAMILY_ARGS,
    MOE_FAMILIES,
    NanoGPT,
    family_config,
    family_model,
    nanogpt,
    token_batches,
)
from tests.models.helpers import lm_loss, train_and_compare

CPU = torch.device("cpu")
README = Path(__file__).resolve().parents[2] / "docs" / "models.md"
TABLE_MARK = "<!-- supported-families:"


def readme_families() -> list[str]:
    """The ``model_type``s of docs/models.md's support table (first column, in backticks), in order."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(TABLE_MARK))
    out: list[str] = []
    for line in lines[start + 3 :]:
        if not line.startswith("|"):
            break
        for name in re.findall(r"`([a-z0-9_]+)`", line.split("|")[1]):
            if name not in out:
                out.append(name)
    return out


FAMILIES = readme_families()
META_FAMILIES = ["gpt2", "phi3", "mixtral", "gemma3_text", "deepseek_v3", "gpt_oss"]


def make_engine(model: nn.Module, **cfg) -> SlideDPEngine:
    return SlideDPEngine(model, EngineConfig(**cfg), device=CPU, compute_dtype=torch.float32)


def gpt_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x, x)[1]


def batches(n: int) -> list[torch.Tensor]:
    return token_batches(n, batch=2, seq=12)


# -- docs/models.md's table is what is tested -----------------------------------------------------------------


def test_readme_table_lists_the_tested_families() -> None:
    assert set(FAMILIES) == set(FAMILY_ARGS) | {"gpt2"}
    beyond = set(FAMILIES) - {"qwen3", "qwen2", "llama", "mistral", "qwen3_moe"}
    assert len(beyond) >= 8
    assert len(set(MOE_FAMILIES) & beyond) >= 2
    hybrid = [f for f in beyond if "sliding_window" in FAMILY_ARGS.get(f, {})]
    assert len(hybrid) >= 2
    assert "SUPPORTED_MODEL_TYPES" not in vars(slidedp_lightning.models.hf_decoder)  # no list gates the adapter


@pytest.mark.parametrize("family", FAMILIES)
def test_units_found_from_structure(family: str) -> None:
    model = family_model(family)
    assert model.config.model_type == family
    adapter = adapter_for(model)
    assert isinstance(adapter, HFDecoderAdapter)
    specs = adapter.units(model)
    assert [s.name for s in specs] == ["embed", "layers.0", "layers.1", "head"]
    assert model.get_input_embeddings() in specs[0].modules
    assert model.get_output_embeddings() in specs[-1].modules
    layers = model.get_decoder()
    layers = getattr(layers, "layers", None) or layers.h
    assert [s.modules for s in specs[1:-1]] == [(layer,) for layer in layers]
    assert all(s.block for s in specs[1:-1]) and not specs[0].block and not specs[-1].block
    layout = build_layout(model, specs, 1)  # every parameter in exactly one unit
    names = [s.name for u in layout.units for s in u.slots]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters()) and len(set(names)) == len(names)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_like_adamw(family: str) -> None:
    model = family_model(family)
    if family in MOE_FAMILIES and family != "deepseek_v3":  # deepseek_v3's model has no router loss
        assert model(input_ids=batches(1)[0], labels=batches(1)[0]).aux_loss is not None
    train_and_compare(model, lm_loss, batches(3), steps=3)


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("family", FAMILIES)
def test_activation_policies_on_every_family(family: str, policy: str) -> None:
    config = EngineConfig(activation_policy=ActivationPolicy.coerce(policy))
    train_and_compare(family_model(family), lm_loss, batches(2), steps=2, config=config)


def test_segments_refused_where_the_block_is_unknown() -> None:
    with pytest.raises(UnsupportedModelError, match="Gemma3DecoderLayer") as info:
        make_engine(family_model("gemma3_text"), activation_policy=ActivationPolicy.coerce("segments:0101100"))
    for works in ("'full'", "'selective'", "'none'"):
        assert works in str(info.value)


# -- meta init --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_buffers_recomputed_from_the_meta_device(family: str) -> None:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(family_config(family))
    assert any(b.is_meta for b in model.buffers()) or family == "gpt2"
    HFDecoderAdapter().materialize_buffers(model)
    eager = dict(family_model(family).named_buffers())
    assert dict(model.named_buffers()).keys() == eager.keys()
    for name, buf in model.named_buffers():
        assert buf.device.type == "cpu" and torch.equal(buf, eager[name]), name


@pytest.mark.parametrize("family", META_FAMILIES)
def test_meta_init_draws_what_transformers_draws(family: str) -> None:
    """Units initialized one at a time from the meta device hold exactly what transformers' own
    ``initialize_weights`` draws after the same seed, the buffers are the eager model's, and it trains."""
    config = family_config(family, tied=False)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
        ref = transformers.AutoModelForCausalLM.from_config(config)
    ref.to_empty(device="cpu")
    eager = family_model(family, tied=False)
    with torch.no_grad():
        for name, buf in eager.named_buffers():
            ref.get_buffer(name).copy_(buf)
    torch.manual_seed(3)
    ref.initialize_weights()
    torch.manual_seed(3)
    engine = make_engine(model)
    try:
        weights, expected = engine.state_dict(), ref.state_dict()
        assert weights.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(weights[name], value), name
        for name, buf in eager.named_buffers():
            assert torch.equal(model.get_buffer(name), buf), name
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine.attach_optimizer(opt)
        x = batches(1)[0]
        loss = lm_loss(model, x)
        loss.backward()
        assert engine.end_step()
        with torch.no_grad():
            assert abs(loss.item() - lm_loss(ref, x).item()) <= 1e-5 * loss.item()
    finally:
        engine.close()


def test_meta_buffer_no_init_computes_is_refused() -> None:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(family_config("gemma2"))
    model.model.layers[0].mlp.register_buffer(
        "table", torch.empty(4, dtype=torch.int64, device="meta"), persistent=False
    )
    with pytest.raises(UnsupportedModelError, match=r"\['table'\] of model.layers.0.mlp \(Gemma2MLP\)"):
        HFDecoderAdapter().materialize_buffers(model)


# -- refusals ---------------------------------------------------------------------------------------------------


class Wrapper(nn.Module):
    """A LightningModule's place: the model as an attribute."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


def _t5() -> nn.Module:
    cfg = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2, decoder_start_token_id=0, pad_token_id=0
    )
    return transformers.T5ForConditionalGeneration(cfg)


def _bart() -> nn.Module:
    cfg = transformers.BartConfig(
        vocab_size=64,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=32,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
        decoder_start_token_id=0,
    )
    return transformers.BartForConditionalGeneration(cfg)


@pytest.mark.parametrize("make", [_t5, _bart], ids=["t5", "bart"])
def test_encoder_decoder_refused(make) -> None:
    model = make()
    with pytest.raises(UnsupportedModelError, match="encoder-decoder") as info:
        make_engine(Wrapper(model))
    assert type(model).__name__ in str(info.value)


def test_parameter_used_outside_a_module_call_refused() -> None:
    model = family_model("llama")
    model.model.register_parameter("scale", nn.Parameter(torch.ones(64)))
    with pytest.raises(UnsupportedModelError, match=r"'model' \(LlamaModel\) holds parameter\(s\) \['scale'\]"):
        make_engine(model)


def test_transformers_model_without_layers_refused() -> None:
    model = family_model("olmo2")
    model.model.layers = nn.ModuleList()
    with pytest.raises(UnsupportedModelError, match="no block list in Olmo2ForCausalLM"):
        make_engine(model)


def test_no_block_list_error_names_the_model_passed() -> None:
    class Regressor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

    with pytest.raises(UnsupportedModelError, match="found no block list in Regressor") as info:
        make_engine(Regressor())
    assert "stream_blocks" in str(info.value) and "Linear" not in str(info.value).split(":")[0]


# -- user models with a block list ------------------------------------------------------------------------------


@pytest.mark.parametrize("head_first", [False, True], ids=["nanogpt", "litgpt_order"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_block_list_found_and_units(tied: bool, head_first: bool) -> None:
    model = nanogpt(tied=tied, head_first=head_first)
    assert isinstance(adapter_for(model), BlockListAdapter)
    specs = adapter_for(model).units(model)
    t = model.transformer
    assert [s.name for s in specs] == ["embed", "layers.0", "layers.1", "head"]
    assert specs[0].modules == (t.wte, t.wpe)
    assert specs[-1].modules == (t.ln_f, model.lm_head)  # the head side even when registered first
    layout = build_layout(model, specs, 1)
    holders = {(id(m), attr) for m, attr in layout.units[0].slots[0].locations}  # tied: one slot, two holders
    assert holders == {(id(t.wte), "weight")} | ({(id(model.lm_head), "weight")} if tied else set())
    needs = dict((id(m), units) for m, units in layout.compute_modules)
    assert needs[id(model.lm_head)] == ((0,) if tied else (3,))


@pytest.mark.parametrize("policy", ["none", "full", "selective"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_block_list_trains_like_adamw(tied: bool, policy: str) -> None:
    config = EngineConfig(activation_policy=ActivationPolicy.coerce(policy))
    train_and_compare(nanogpt(tied=tied, head_first=not tied), gpt_loss, batches(3), steps=3, config=config)


def test_block_list_inside_a_wrapper_trains() -> None:
    root = Wrapper(nanogpt())
    assert find_streamed_model(root) is root

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return gpt_loss(m.inner, x)

    train_and_compare(root, loss_fn, batches(2), steps=2)


class TwoStacks(NanoGPT):
    """Two block lists of equal size: which one streams is ambiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.ModuleList(type(b)(32, 2) for b in self.transformer.h)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1]))
        for block in [*t.h, *self.extra]:
            x = block(x)
        logits = self.lm_head(t.ln_f(x))
        return logits, nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten())


def test_ambiguous_block_lists_need_a_name() -> None:
    torch.manual_seed(0)
    model = TwoStacks()
    with pytest.raises(UnsupportedModelError, match="found no block list in TwoStacks") as info:
        make_engine(model)
    for text in ("ambiguous", "'transformer.h' (2 x Block", "'extra' (2 x Block", "stream_blocks(model,"):
        assert text in str(info.value)
    assert stream_blocks(model, "transformer.h") is model
    assert slidedp_lightning.stream_blocks is stream_blocks
    specs = adapter_for(model).units(model)
    assert [s.name for s in specs] == ["embed", "layers.0", "layers.1", "head"]
    assert specs[-1].modules[-2:] == tuple(model.extra)  # the other list: side modules, each called
    train_and_compare(model, gpt_loss, batches(2), steps=2)


def test_block_list_named_wrongly() -> None:
    model = nanogpt()
    with pytest.raises(UnsupportedModelError, match="no submodule 'transformer.hh'") as info:
        stream_blocks(model, "transformer.hh")
    assert "'transformer.h' (2 x Block" in str(info.value)
    with pytest.raises(UnsupportedModelError, match="'transformer.wte' of NanoGPT is a Embedding, not"):
        stream_blocks(model, "transformer.wte")
    assert "_slidedp_blocks" not in vars(model)


def test_segments_refused_for_user_blocks() -> None:
    with pytest.raises(UnsupportedModelError, match="does not know Block") as info:
        make_engine(nanogpt(), activation_policy=ActivationPolicy.coerce("segments:1000000"))
    assert "'full', 'selective' and 'none'" in str(info.value)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_block_list_meta_init_equals_eager(tied: bool) -> None:
    """reset_parameters() unit by unit draws what the constructors drew (in the same order) after the same seed."""
    with torch.device("meta"):
        model = NanoGPT(tied=tied)
    torch.manual_seed(7)
    engine = make_engine(model)
    try:
        weights, eager = engine.state_dict(), nanogpt(seed=7, tied=tied).state_dict()
        assert weights.keys() == eager.keys()
        for name, value in eager.items():
            assert torch.equal(weights[name], value), name
    finally:
        engine.close()


def test_block_list_meta_init_needs_reset_parameters() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(32))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.gain

    with torch.device("meta"):
        model = NanoGPT()
        model.transformer.ln_f = Scale()
    with pytest.raises(UnsupportedModelError, match=r"transformer.ln_f \(Scale\) owns parameters and has no reset"):
        adapter_for(model).units(model)  # refused with the units, before any ledger exists


def test_block_list_meta_buffers_refused() -> None:
    with torch.device("meta"):
        model = NanoGPT()
        model.transformer.h[0].attn.register_buffer("mask", torch.ones(4, 4))
    with pytest.raises(UnsupportedModelError, match=r"\['transformer.h.0.attn.mask'\]"):
        make_engine(model)


def test_copy_of_a_named_model_stays_named() -> None:
    clone = copy.deepcopy(stream_blocks(TwoStacks(), "extra"))
    specs = adapter_for(clone).units(clone)
    assert [s.modules for s in specs if s.block] == [(b,) for b in clone.extra]
    assert specs[0].modules[:2] == (clone.transformer.wte, clone.transformer.wpe)
    assert specs[0].modules[-2:] == tuple(clone.transformer.h)  # called before the named blocks
