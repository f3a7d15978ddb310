"""Host ledger size of one model under full fine-tuning, LoRA and frozen embeddings, and in each ledger mode
(``optimizer_state`` x ``bf16_copy``), one CPU process each.

A frozen parameter keeps one copy of its weights and no moments, whether its whole unit is frozen or it sits
beside trainable ones (a LoRA block's base weights: laid out after the adapters, beyond the unit's moments and,
under bf16 compute, its FP32 master). Prints one row per case and precision (``engine.ledger_stats()``).

Usage: `python experiments/ledger_frozen.py [--hidden 768] [--layers 12] [--vocab 32000] [--rank 8]`
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from slidedp_lightning.runtime.engine import EngineConfig, SlideDPEngine
from slidedp_lightning.runtime.host_os import format_bytes

log = logging.getLogger("ledger_frozen")


def build(args: argparse.Namespace, case: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    model: torch.nn.Module = Qwen3ForCausalLM(config)
    if case == "frozen-embeddings":
        model.model.embed_tokens.requires_grad_(False)
    elif case.startswith("lora"):
        import peft

        lora = peft.LoraConfig(
            r=args.rank, lora_alpha=2 * args.rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
        )
        model = peft.get_peft_model(model, lora)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        base = None
        for case in ("full", "frozen-embeddings", "lora"):
            model = build(args, case)
            engine = SlideDPEngine(model, EngineConfig(), device=torch.device("cpu"), compute_dtype=dtype)
            try:
                s = engine.ledger_stats()
                units = engine.layout.units
                frozen_units = sum(u.frozen for u in units)
            finally:
                engine.close(restore=False)
            base = base or s.nbytes
            rows.append(
                f"| {str(dtype).split('.')[-1]} | {case} | {s.num_params:,} | "
                f"{s.trainable_params:,} | {s.frozen_params:,} | {frozen_units}/{len(units)} | "
                f"{format_bytes(s.nbytes)} | {s.bytes_per_param:.2f} | {s.trainable_bytes_per_param:.2f} | "
                f"{s.frozen_bytes_per_param:.2f} | {s.nbytes / base:.3f} |"
            )
    print(
        "| compute | case | params | trainable | frozen | wholly frozen units | ledger | B/param | "
        "B/param (trainable) | B/param (frozen) | vs full |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("| optimizer_state | bf16_copy | case | ledger | B/param | vs default |")
    print("|---|---|---|---|---|---|")
    default = None
    for state, copy in (("fp32", True), ("fp32", False), ("int8", True), ("int8", False)):
        for case in ("full", "lora"):
            model = build(args, case)
            config = EngineConfig(optimizer_state=state, bf16_copy=copy)
            engine = SlideDPEngine(model, config, device=torch.device("cpu"), compute_dtype=torch.bfloat16)
            try:
                s = engine.ledger_stats()
            finally:
                engine.close(restore=False)
            default = default or s.nbytes
            print(
                f"| {state} | {copy} | {case} | {format_bytes(s.nbytes)} | {s.bytes_per_param:.2f} | {s.nbytes / default:.3f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
