"""One-GPU check: SlideDP vs plain PyTorch on a Qwen3-architecture model, plus pinned vs pageable copies.

    python bench/gpu_check.py --out "$OUT"                 # ~1.7 B params, BF16, on the first CUDA device
    python bench/gpu_check.py --device cpu --tiny          # the same code path on a tiny model, for a dry run

Plain PyTorch: the whole model on the device, FP32 weights, BF16 autocast, ``torch.optim.AdamW(fused=True)``.
SlideDP: the engine on one device, BF16 units streamed from the host ledger, CPU AdamW. Both start from the same
weights (built on the CPU from one seed; ``--meta-init``: SlideDP initializes on the meta device unit by unit
instead, as for models that do not fit in host memory twice) and run the same random batches, so their losses
must agree to BF16 precision; warm-up steps are excluded from the timings.
Two cases: ``--batch`` without activation checkpointing, then ``--large-batch`` with every decoder block
checkpointed in both systems (HF gradient checkpointing / ``activation_policy="full"``), where the GPU's share
of a step grows and SlideDP's host work can hide behind it.
Writes ``gpu_check.json`` and the SlideDP lane trace of the first case under ``--out`` and prints a table last.
No installs: the repository and its dependencies only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from slidedp_lightning.runtime import EngineConfig, SlideDPEngine
from slidedp_lightning.runtime.activation_policy import ActivationPolicy


def qwen3_config(tiny: bool, shape: str = "qwen3-1.7b") -> Qwen3Config:
    if tiny:
        return Qwen3Config(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=True,
            max_position_embeddings=4096,
            attn_implementation="sdpa",
        )
    if shape == "qwen3-8b":  # Qwen3-8B shapes: ~8.2 B parameters, untied; FP32 + AdamW on the GPU: ~131 GB of state
        return Qwen3Config(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=False,
            max_position_embeddings=40960,
            attn_implementation="sdpa",
        )
    # Qwen3-1.7B shapes: ~1.7 B parameters with tied embeddings
    return Qwen3Config(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        attn_implementation="sdpa",
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int) -> dict[str, float]:
    """GB/s of host->device and device->host copies from pinned and from pageable host memory."""
    if device.type != "cuda" or nbytes == 0:
        return {}
    out = {}
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for kind, pinned in (("pinned", True), ("pageable", False)):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        host.fill_(1)
        for direction in ("h2d", "d2h"):
            times = []
            for _ in range(4):
                sync(device)
                t0 = time.perf_counter()
                if direction == "h2d":
                    dev.copy_(host, non_blocking=pinned)
                else:
                    host.copy_(dev, non_blocking=pinned)
                sync(device)
                times.append(time.perf_counter() - t0)
            out[f"{direction}_{kind}_GBps"] = nbytes / statistics.median(times[1:]) / 1e9
    return out


def batches(vocab: int, batch: int, seq: int, n: int, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(n)]


def peak_device_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def train(model, data: list[torch.Tensor], warmup: int, device: torch.device, finish) -> tuple[list, list]:
    """Step times (after ``warmup`` steps) and losses; ``finish`` ends a step after backward."""
    times, losses = [], []
    for i, x in enumerate(data):
        sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        finish()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return times, losses


def run_plain(
    cfg: Qwen3Config, data: list[torch.Tensor], warmup: int, device: torch.device, checkpointing: bool, on_device: bool
) -> dict:
    """``on_device``: draw the weights on the device itself (fast; not SlideDP's weights, so no loss comparison)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if on_device:
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg)
    else:
        model = seeded_model(cfg).to(device)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")

    def finish() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    times, losses = train(model, data, warmup, device, finish)
    result = {
        "step_s": statistics.median(times),
        "peak_device_bytes": peak_device_bytes(device),
        "host_rss_bytes": rss_bytes(),
        "losses": losses,
    }
    finish = opt = model = None  # free the device memory before empty_cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def seeded_model(cfg: Qwen3Config) -> Qwen3ForCausalLM:
    """The model both systems start from: FP32 on the CPU, initialized from seed 0."""
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg)


def run_slidedp(
    cfg: Qwen3Config,
    data: list[torch.Tensor],
    warmup: int,
    device: torch.device,
    trace_dir: Path | None,
    checkpointing: bool,
    meta_init: bool,
    optimizer_state: str,
    bf16_copy: bool,
) -> dict:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    if meta_init:
        with torch.device("meta"):
            model = Qwen3ForCausalLM(cfg)
    else:
        model = seeded_model(cfg)
    config = EngineConfig(
        trace_dir=str(trace_dir) if trace_dir else None,
        activation_policy=ActivationPolicy.coerce("full" if checkpointing else None),
        optimizer_state=optimizer_state,
        bf16_copy=bf16_copy,
    )
    engine = SlideDPEngine(model, config, device=device, compute_dtype=torch.bfloat16)
    setup_s = time.perf_counter() - t0
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-5))
    try:
        times, losses = train(model, data, warmup, device, engine.end_step)
        engine.synchronize()
        result = {
            "step_s": statistics.median(times),
            "setup_s": setup_s,
            "peak_device_bytes": peak_device_bytes(device),
            "peak_resident_unit_bytes": engine.device_memory()["peak_resident_param_bytes"],
            "ledger_bytes": engine.ledger_stats().nbytes,
            "host_rss_bytes": rss_bytes(),
            "losses": losses,
        }
    finally:
        engine.close(restore=False)
    steps = [m for step, m in sorted(engine.tracer.metrics.items()) if step >= warmup]
    for key in ("exposed_host", "overlap_fraction", "busy_h2d", "busy_update", "busy_reduce", "busy_stall"):
        result[key] = statistics.median(m[key] for m in steps) if steps else None
    return result


def compare(
    cfg: Qwen3Config, batch: int, checkpointing: bool, args, device: torch.device, trace_dir: Path | None, save
) -> dict:
    """Plain PyTorch, then SlideDP, on the same batches; a failure (OOM, host-memory refusal) is a result too."""
    data = batches(cfg.vocab_size, batch, args.seq, args.steps, device)
    case = {"batch": batch, "checkpointing": checkpointing}
    for name, fn in (
        ("plain", lambda: run_plain(cfg, data, args.warmup, device, checkpointing, args.meta_init)),
        (
            "slidedp",
            lambda: run_slidedp(
                cfg,
                data,
                args.warmup,
                device,
                trace_dir,
                checkpointing,
                args.meta_init,
                args.optimizer_state,
                not args.no_bf16_copy,
            ),
        ),
    ):
        try:
            case[name] = fn()
            case[name]["tokens_per_s"] = batch * args.seq / case[name]["step_s"]
            if args.peak_tflops and device.type == "cuda":
                flops = flops_per_token(cfg, args.seq) * case[name]["tokens_per_s"]
                case[name]["mfu"] = flops / (args.peak_tflops * 1e12)
        except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
            case[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        save(case)
    if "losses" in case["plain"] and "losses" in case["slidedp"] and not args.meta_init:
        case["max_abs_loss_diff"] = max(abs(a - b) for a, b in zip(case["plain"]["losses"], case["slidedp"]["losses"]))
        save(case)
    return case


def flops_per_token(cfg: Qwen3Config, seq: int) -> float:
    """Model FLOPs of one trained token, recomputation excluded (the MFU convention of PaLM, arXiv 2204.02311,
    appendix B): 6 per weight of every matmul (the input embedding is a lookup unless the head shares it) plus the
    attention scores and values, 12 x layers x heads x head_dim x seq."""
    embedding = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    with torch.device("meta"):
        n = sum(p.numel() for p in Qwen3ForCausalLM(cfg).parameters())
    attention = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq
    return 6 * (n - embedding) + attention


def table_row(name: str, batch: int, checkpointing: bool, r: dict) -> str:
    gib = 1 << 30
    head = f"| {name} | {batch} | {'yes' if checkpointing else 'no'} "
    if "error" in r:
        return head + f"| - | - | - | - | - | - | - | - | {r['error'][:80]} |"
    dev = f"{r['peak_device_bytes'] / gib:.2f}" if r["peak_device_bytes"] is not None else "n/a (cpu)"
    ledger = f"{r['ledger_bytes'] / gib:.2f}" if "ledger_bytes" in r else "-"
    exposed = f"{r['exposed_host']:.3f}" if r.get("exposed_host") is not None else "-"
    if r.get("exposed_host") is not None:
        exposed += f" ({r['exposed_host'] / r['step_s']:.0%})"
    overlap = f"{r['overlap_fraction']:.2f}" if r.get("overlap_fraction") is not None else "-"
    mfu = f"{r['mfu']:.1%}" if "mfu" in r else "-"
    return head + (
        f"| {r['tokens_per_s']:.0f} | {mfu} | {r['step_s']:.3f} | {dev} | {r['host_rss_bytes'] / gib:.2f} "
        f"| {ledger} | {exposed} | {overlap} | |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (dry run of the code path)")
    ap.add_argument("--shape", default="qwen3-1.7b", choices=("qwen3-1.7b", "qwen3-8b"), help="the model's shapes")
    ap.add_argument("--batch", type=int, default=8, help="first case, no activation checkpointing (0: off)")
    ap.add_argument("--large-batch", type=int, default=32, help="second case, with activation checkpointing (0: off)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--copy-mib", type=int, default=1024, help="buffer size for the copy-bandwidth check")
    ap.add_argument(
        "--meta-init",
        action="store_true",
        help="SlideDP initializes on the meta device, plain PyTorch on the device itself (no loss check)",
    )
    ap.add_argument("--optimizer-state", default="fp32", choices=("fp32", "int8"), help="SlideDP's Adam moments")
    ap.add_argument("--no-bf16-copy", action="store_true", help="SlideDP keeps no BF16 transfer copy")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense BF16 peak, for MFU")
    ap.add_argument("--out", default=os.environ.get("OUT", "results/gpu_check"))
    args = ap.parse_args()
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = qwen3_config(args.tiny, args.shape)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in Qwen3ForCausalLM(cfg).parameters())
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "params": n_params,
        "shape": "tiny" if args.tiny else args.shape,
        "batch": args.batch,
        "seq": args.seq,
        "optimizer_state": args.optimizer_state,
        "bf16_copy": not args.no_bf16_copy,
        "copies": copy_bandwidth(device, args.copy_mib << 20),
    }

    def save(key: str):
        def write(case: dict) -> None:
            if key == "first":
                report.update({k: v for k, v in case.items() if k in ("plain", "slidedp", "max_abs_loss_diff")})
            else:
                report[key] = case
            (out / "gpu_check.json").write_text(json.dumps(report, indent=1))

        return write

    cases = []
    if args.batch:
        cases.append(compare(cfg, args.batch, False, args, device, out / "slidedp_trace", save("first")))
    if args.large_batch:
        # traced too (the lane metrics); kept under --out only when it is the one case
        trace = Path(tempfile.mkdtemp(prefix="gpu_check_trace_")) if args.batch else out / "slidedp_trace"
        cases.append(compare(cfg, args.large_batch, True, args, device, trace, save("large")))
    print(f"\n{report['device']}, torch {report['torch']}, {n_params / 1e9:.2f} B params, seq {args.seq}")
    for k, v in report["copies"].items():
        print(f"  {k}: {v:.1f}")
    print(
        "| system | batch | checkpointing | tokens/s | MFU | step s | peak device GiB | host RSS GiB | ledger GiB "
        "| exposed host s (of step) | overlap | error |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        for name in ("plain", "slidedp"):
            print(table_row(name, case["batch"], case["checkpointing"], case[name]))
    for case in cases:
        if "max_abs_loss_diff" in case:
            print(
                f"batch {case['batch']}: max |plain - SlideDP| per-step loss {case['max_abs_loss_diff']:.4f} "
                f"(same initial weights and batches; BF16 weights vs FP32 weights under BF16 autocast)"
            )
    print(f"json: {out / 'gpu_check.json'}; SlideDP lanes: tensorboard --logdir {out / 'slidedp_trace'}")


if __name__ == "__main__":
    main()
