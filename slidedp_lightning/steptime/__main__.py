"""``python -m slidedp_lightning.steptime {predict,calibrate,profiles}``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Sequence

from slidedp_lightning.steptime.analytic import analyze
from slidedp_lightning.steptime.graph import GRAD_ROUTES, LANES, PARAM_ROUTES, PRECISIONS, StepConfig
from slidedp_lightning.steptime.profiles import load_profile, shipped_profiles
from slidedp_lightning.steptime.simulate import simulate
from slidedp_lightning.steptime.workload import ACTIVATION_POLICIES, load_config


def predict_table(cfg: StepConfig, profile_name: str) -> str:
    """The breakdown of one step as a text table (simulator, with the analytic bounds beside it)."""
    profile = load_profile(profile_name)
    sim, ana = simulate(cfg, profile), analyze(cfg, profile)
    lines = [
        f"model {cfg.model.name} ({cfg.model.total_params / 1e9:.2f} B params) | hardware {profile.name} | R={cfg.gpus} "
        f"| batch {cfg.batch}/GPU x seq {cfg.seq} | routes {cfg.param_route}/{cfg.grad_route} | chunk {cfg.chunk_bytes} "
        f"| window {cfg.prefetch_window} | activations {cfg.activation if isinstance(cfg.activation, str) else 'custom'}",
        f"{'':22s}{'simulator':>12s}{'analytic':>12s}",
        f"{'step time (s)':22s}{sim.step_time:12.4f}{ana.step_time:12.4f}",
        f"{'tokens/s':22s}{sim.tokens_per_s:12.1f}{ana.tokens_per_s:12.1f}",
        f"{'bottleneck':22s}{sim.bottleneck:>22s}   (analytic: {ana.bottleneck})",
        "",
        f"{'lane':10s}{'busy (s)':>12s}{'exposed (s)':>13s}{'service (s)':>13s}",
    ]
    lines += [f"{lane:10s}{sim.busy[lane]:12.4f}{sim.exposed[lane]:13.4f}{ana.lanes[lane]:13.4f}" for lane in LANES]
    lines += ["", f"{'resource':10s}{'lower bound (s)':>16s}"]
    lines += [f"{res:10s}{t:16.4f}" for res, t in sorted(ana.bounds.items(), key=lambda kv: -kv[1])]
    lines.append(f"dependency exposure (analytic): {ana.exposure:.4f} s")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m slidedp_lightning.steptime", description="SlideDP step-time model")
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("predict", help="predict one step's time and where it goes")
    pr.add_argument("--model", required=True, help="config JSON, checkpoint directory, or qwen3-8b | qwen3-14b | qwen3-tiny")
    pr.add_argument("--hardware", required=True, help=f"profile JSON from calibrate, or one of {shipped_profiles()}")
    pr.add_argument("--batch", type=int, required=True, help="sequences per GPU per step")
    pr.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    pr.add_argument("--gpus", type=int, required=True, help="R, ranks (GPUs) training together")
    pr.add_argument("--param-route", default="full", choices=PARAM_ROUTES)
    pr.add_argument("--grad-route", default="gpu_reduce", choices=GRAD_ROUTES)
    pr.add_argument("--chunk-bytes", type=int, default=None, help="gradient chunk bytes (default: whole units)")
    pr.add_argument("--prefetch-window", type=int, default=2, help="units resident ahead")
    pr.add_argument("--activation", default="none", choices=ACTIVATION_POLICIES, help="activation checkpointing")
    pr.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS)
    ca = sub.add_parser("calibrate", help="measure this machine and write its profile JSON")
    ca.add_argument("--out", default="this_machine.json", help="profile JSON to write")
    ca.add_argument("--ranks", type=int, default=2, help="CPU ranks measured at once")
    ca.add_argument("--model", default="qwen3-tiny", help="shipped model whose shapes the compute is measured on")
    ca.add_argument("--seq", type=int, default=26, help="sequence length of the compute measurement")
    sub.add_parser("profiles", help="list the shipped hardware profiles")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.cmd == "profiles":
            for name in shipped_profiles():
                print(f"{name:18s} {load_profile(name).description}")
        elif args.cmd == "predict":
            cfg = StepConfig(load_config(args.model), args.batch, args.seq, args.gpus, args.param_route,
                             args.grad_route, args.chunk_bytes, args.prefetch_window, args.activation, args.precision)
            print(predict_table(cfg, args.hardware))
        else:
            from slidedp_lightning.steptime.calibrate import build_profile, measure

            raw = measure(args.ranks, args.model, args.seq)
            profile = build_profile(raw, args.ranks, args.model, args.seq)
            with open(args.out, "w") as f:
                json.dump(profile.to_json(), f, indent=1)
            print(f"wrote {args.out}")
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
