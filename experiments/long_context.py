"""Longest trainable sequence at a device memory budget: SlideDP vs FSDP2 vs DDP, from measured accounting.

SlideDP's runtime accounts the activation bytes each decoder block retains (``engine.device_memory()``); this
script measures them on one process at two sequence lengths for a policy and for no checkpointing, fits
``a + b*S + c*S^2`` per block (the ``S^2`` term is eager attention's score matrix), and adds what each system
keeps on the device besides activations:

- SlideDP: the streamed parameters (prefetch window + the unit in use, compute dtype) and one unit's FP32
  gradient; the blocks under the given activation policy; the loss in chunks of ``--loss-chunk`` tokens
  (one chunk of FP32 logits) — or full FP32 logits and their gradient without it;
- DDP: FP32 weights, gradients and both Adam moments (16 B/param), every block without checkpointing, full
  FP32 logits and their gradient;
- FSDP2: 16 B/param / R, one gathered block, every block without checkpointing, full logits.

On a CPU-only machine these are accounting numbers, not allocator peaks; the transient working set of the
block being computed is counted as that block's no-checkpointing bytes.

    python experiments/long_context.py --budget-gib 80 --ranks 4 --policy full@1 --loss-chunk 4096
"""

from __future__ import annotations

import argparse
import json

import torch


def measure(config, policy: str, seq: int, batch: int) -> int:
    """Activation bytes all blocks retain in one step at ``seq`` (one process, CPU)."""
    from transformers import AutoModelForCausalLM

    from slidedp_lightning.runtime.activation_policy import ActivationPolicy
    from slidedp_lightning.runtime.engine import EngineConfig, SlideDPEngine

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    engine = SlideDPEngine(
        model,
        EngineConfig(activation_policy=ActivationPolicy.coerce(policy)),
        device=torch.device("cpu"),
        compute_dtype=torch.float32,
    )
    try:
        engine.attach_optimizer(torch.optim.AdamW(model.parameters()))
        x = torch.randint(0, config.vocab_size, (batch, seq))
        model(input_ids=x, labels=x).loss.backward()
        engine.end_step()
        return engine.device_memory()["retained_activation_bytes"]
    finally:
        engine.close(restore=False)


def fit(points: dict[int, int]) -> tuple[float, float, float]:
    """``a + b*S + c*S^2`` through three (seq, bytes) points."""
    (s1, y1), (s2, y2), (s3, y3) = sorted(points.items())
    matrix = torch.tensor([[1.0, s, s * s] for s in (s1, s2, s3)], dtype=torch.float64)
    a, b, c = torch.linalg.solve(matrix, torch.tensor([y1, y2, y3], dtype=torch.float64)).tolist()
    return a, b, c


def longest(need, budget: float, limit: int = 1 << 24) -> int:
    """The largest sequence length whose ``need(S)`` fits ``budget`` (0 if none)."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid) <= budget else (lo, mid - 1)
    return lo


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="transformers config JSON (default: the tiny Qwen3 of the recipes)")
    p.add_argument("--budget-gib", type=float, default=0.05, help="device memory per rank")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--policy", default="full@1", help="SlideDP activation policy")
    p.add_argument("--loss-chunk", type=int, default=1024, help="SlideDP loss chunk in tokens (0: none)")
    args = p.parse_args(argv)
    from transformers import AutoConfig

    from slidedp_lightning.recipes.finetune import load_tiny_config

    config = AutoConfig.from_pretrained(args.config) if args.config else load_tiny_config()[0]
    config.max_position_embeddings = max(config.max_position_embeddings, 64)
    seqs = (16, 32, 64)
    blocks_policy = fit({s: measure(config, args.policy, s, args.batch) for s in seqs})
    blocks_none = fit({s: measure(config, "none", s, args.batch) for s in seqs})
    layers = config.num_hidden_layers
    per_block_none = tuple(c / layers for c in blocks_none)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in meta.parameters())
    block = sum(p.numel() for p in meta.model.layers[0].parameters())
    unit = max(block, config.vocab_size * config.hidden_size)
    vocab, b = config.vocab_size, args.batch

    def poly(c, s):
        return c[0] + c[1] * s + c[2] * s * s

    def logits(s):
        return 2 * b * s * vocab * 4  # FP32 logits and their gradient

    def slidedp(s):
        head = b * min(s, args.loss_chunk) * vocab * 4 * 2 if args.loss_chunk else logits(s)
        return 3 * unit * 4 + unit * 4 + poly(blocks_policy, s) + poly(per_block_none, s) + head

    def ddp(s):
        return 16 * n_params + poly(blocks_none, s) + logits(s)

    def fsdp2(s):
        return 16 * n_params / args.ranks + 4 * block + poly(blocks_none, s) + logits(s)

    budget = args.budget_gib * (1 << 30)
    rows = {name: longest(fn, budget) for name, fn in (("SlideDP", slidedp), ("FSDP2", fsdp2), ("DDP", ddp))}
    print(
        f"device budget {args.budget_gib:g} GiB per rank, {args.ranks} ranks, batch {b}, {n_params:,} params, "
        f"SlideDP policy {args.policy}, loss chunk {args.loss_chunk or 'none'}"
    )
    print("| system | longest sequence |\n|---|---|")
    for name, s in rows.items():
        print(f"| {name} | {s:,} |")
    print(json.dumps({"fit_bytes_per_seq": {"policy": blocks_policy, "none": blocks_none}, "longest": rows}))


if __name__ == "__main__":
    main()
