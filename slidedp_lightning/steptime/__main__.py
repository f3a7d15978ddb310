"""``python -m slidedp_lightning.steptime {predict,scaling,calibrate,loop,disk,profiles}``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from slidedp_lightning.constants import GRAD_ROUTES, HOST_LAYOUTS, OPTIMIZER_STATES
from slidedp_lightning.steptime.analytic import Analytic, analyze
from slidedp_lightning.steptime.graph import (
    LANES,
    PARAM_ROUTES,
    PRECISIONS,
    StepConfig,
    host_ledger_bytes,
    host_update_bytes,
)
from slidedp_lightning.steptime.profiles import Profile, load_profile, shipped_networks, shipped_profiles
from slidedp_lightning.steptime.simulate import simulate
from slidedp_lightning.steptime.workload import ACTIVATION_POLICIES, load_config

# what limits a step, by the resource with the largest lower bound
LIMITS = {
    "gpu": "GPU-bound",
    "net": "network-bound",
    "cpu": "host-update-bound",
    "updater": "host-update-bound",
    "dram": "host-DRAM-bound",
    "h2d": "PCIe-bound (h2d)",
    "d2h": "PCIe-bound (d2h)",
    "link": "GPU-link-bound",
    "cores": "CPU-cores-bound",
    "disk": "disk-bound",
}
SCALING_GPUS = (16, 32, 64, 128)


def limit(ana: Analytic) -> str:
    """The resource whose lower bound is largest, in words (``network-bound``, ``host-update-bound``, ...)."""
    res = max(ana.bounds, key=lambda k: ana.bounds[k])
    return LIMITS.get(res, res)


def resolve_profile(hardware: str | Profile, network: str | None = None) -> Profile:
    profile = hardware if isinstance(hardware, Profile) else load_profile(hardware)
    return profile.with_network(network) if network else profile


def predict_table(cfg: StepConfig, profile_name: str | Profile, network: str | None = None) -> str:
    """The breakdown of one step as a text table (simulator, with the analytic bounds beside it)."""
    profile = resolve_profile(profile_name, network)
    sim, ana = simulate(cfg, profile), analyze(cfg, profile)
    lines = [
        f"model {cfg.model.name} ({cfg.model.total_params / 1e9:.2f} B params) | hardware {profile.name} | R={cfg.gpus} "
        f"| batch {cfg.batch}/GPU x seq {cfg.seq} | routes {cfg.param_route}/{cfg.grad_route} | chunk {cfg.chunk_bytes} "
        f"| window {cfg.prefetch_window} | activations {cfg.activation if isinstance(cfg.activation, str) else 'custom'}",
    ]
    if cfg.hosts > 1:
        where = (
            f" | co-located: {cfg.hosts * cfg.gpus} ranks share {profile.colocated_cores:.2f} cores"
            if profile.colocated
            else ""
        )
        lines.append(
            f"hosts N={cfg.hosts} ({cfg.hosts * cfg.gpus} GPUs) | layout {cfg.host_layout} | network "
            f"{profile.net_gbps:g} GB/s per host, {profile.net_latency_s * 1e6:g} us per step{where}"
        )
    lines += [
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
    lines.append(f"limit: {limit(ana)}")
    if cfg.param_route not in ("replicated", "slideformer"):
        lines.append(
            f"per host: ledger {host_ledger_bytes(cfg) / 1e9:.1f} GB, CPU update "
            f"{host_update_bytes(cfg) / 1e9:.1f} GB per step"
        )
    return "\n".join(lines)


def scaling_rows(base: StepConfig, profile: Profile, gpus: tuple[int, ...] = SCALING_GPUS) -> list[dict]:
    """Both host layouts at each total GPU count (``base.gpus`` per host): step time, tokens/s, limit, winner.

    The replicated layout keeps ``base.param_route``; the host-sharded layout gathers parameters (route sharded)."""
    rows = []
    for total in gpus:
        if total % base.gpus:
            raise ValueError(f"{total} GPUs is not a multiple of {base.gpus} per host")
        n = total // base.gpus
        row: dict = {"gpus": total, "hosts": n}
        for layout in HOST_LAYOUTS:
            route = base.param_route if layout == "replicated" else "sharded"
            cfg = StepConfig(
                base.model,
                base.batch,
                base.seq,
                base.gpus,
                route,
                base.grad_route,
                base.chunk_bytes,
                base.prefetch_window,
                base.activation,
                base.precision,
                n,
                layout,
                base.max_units_in_flight,
                base.loss_sync,
            )
            sim, ana = simulate(cfg, profile), analyze(cfg, profile)
            row[layout] = {
                "step_time": sim.step_time,
                "tokens_per_s": sim.tokens_per_s,
                "limit": limit(ana),
                "bounds": ana.bounds,
                "ledger_gb": host_ledger_bytes(cfg) / 1e9,
                "label": sim.bottleneck,
            }
        rep, sh = row["replicated"], row["sharded"]
        win = "replicated" if rep["step_time"] <= sh["step_time"] else "sharded"
        row["winner"] = win
        row["why"] = _why(win, rep, sh)
        rows.append(row)
    return rows


def _why(win: str, rep: dict, sh: dict) -> str:
    """Why the winner wins, from the two layouts' limits and network bounds."""
    me, lose = (rep, sh) if win == "replicated" else (sh, rep)
    gain = lose["step_time"] / me["step_time"] - 1
    if gain < 0.02:
        return f"tie within 2 %: both {me['limit']}"
    net = lose["bounds"].get("net", 0.0) / max(me["bounds"].get("net", 0.0), 1e-30)
    if win == "sharded":
        if rep["limit"] == "host-update-bound":
            return f"+{gain:.0%}: replicated is host-update-bound; host-sharded updates 1/N per host"
        if rep["limit"] == "network-bound" and sh["limit"] == "network-bound":
            return (
                f"+{gain:.0%}: both network-bound, replicated needs {net:.2f}x the network time; host-sharded's "
                "gathers use the network during the forward too"
            )
        return f"+{gain:.0%}: replicated is {rep['limit']}; host-sharded moves 1/N of the host work"
    if sh["limit"] == "network-bound":
        return f"+{gain:.0%}: host-sharded is network-bound and needs {net:.2f}x the network time (gathers every fetch)"
    return f"+{gain:.0%}: host-sharded is {sh['limit']}"


def scaling_table(base: StepConfig, profile: Profile, gpus: tuple[int, ...] = SCALING_GPUS) -> str:
    rows = scaling_rows(base, profile, gpus)
    head = (
        f"model {base.model.name} | hardware {profile.name} ({base.gpus} GPUs per host; network "
        f"{profile.net_gbps:g} GB/s per host) | batch {base.batch}/GPU x seq {base.seq} | precision "
        f"{base.precision} | activations {base.activation if isinstance(base.activation, str) else 'custom'} | "
        f"replicated layout: param route {base.param_route}; host-sharded: sharded"
    )
    lines = [
        head,
        f"{'GPUs':>5s}{'N':>4s} | {'replicated: step s':>18s}{'tokens/s':>10s} {'limit':18s}{'ledger GB':>10s} | "
        f"{'host-sharded: step s':>20s}{'tokens/s':>10s} {'limit':18s}{'ledger GB':>10s} | winner (why)",
    ]
    for r in rows:
        a, b = r["replicated"], r["sharded"]
        lines.append(
            f"{r['gpus']:5d}{r['hosts']:4d} | {a['step_time']:18.2f}{a['tokens_per_s']:10.0f} {a['limit']:18s}"
            f"{a['ledger_gb']:10.1f} | {b['step_time']:20.2f}{b['tokens_per_s']:10.0f} {b['limit']:18s}"
            f"{b['ledger_gb']:10.1f} | {r['winner']} ({r['why']})"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m slidedp_lightning.steptime", description="SlideDP step-time model")
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("predict", help="predict one step's time and where it goes")
    pr.add_argument(
        "--model",
        required=True,
        help="config JSON, checkpoint directory, or qwen3-1.7b | qwen3-8b | qwen3-14b | qwen3-tiny",
    )
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
    pr.add_argument("--hosts", type=int, default=1, help="N, hosts of --gpus ranks each (default 1)")
    pr.add_argument(
        "--host-layout",
        default="replicated",
        choices=HOST_LAYOUTS,
        help="replicated: a full ledger per host; sharded: each host owns 1/N (model only)",
    )
    pr.add_argument(
        "--max-units-in-flight",
        type=int,
        default=None,
        help="the runtime's update backpressure (EngineConfig.max_units_in_flight, 2 there; default: not modelled)",
    )
    pr.add_argument("--optimizer-state", default="fp32", choices=OPTIMIZER_STATES, help="Adam moments: exact or 8-bit")
    pr.add_argument("--no-bf16-copy", action="store_true", help="the ledger keeps no BF16 transfer copy")
    pr.add_argument(
        "--state-on-disk",
        action="store_true",
        help="the moments live in a state file on disk (StateOnDisk); the profile needs disk_gbps (calibrate --state-dir)",
    )
    pr.add_argument(
        "--master-on-disk",
        action="store_true",
        help="with --state-on-disk: the FP32 master in the state file too (StateOnDisk(master=True))",
    )
    pr.add_argument(
        "--loss-sync",
        action="store_true",
        help="the training step all-reduces its loss over every rank (Lightning's sync_dist logging)",
    )
    pr.add_argument(
        "--network",
        default=None,
        help=f"inter-host network, one of {shipped_networks()} or a JSON file (default: the profile's)",
    )
    sc = sub.add_parser("scaling", help="both host layouts at 16, 32, 64, 128 GPUs (--gpus per host)")
    for a in pr._actions:
        if a.dest not in ("help", "hosts", "host_layout", "gpus", "param_route"):
            sc._add_action(a)
    sc.add_argument("--gpus", type=int, default=8, help="GPUs per host (default 8)")
    sc.add_argument(
        "--param-route",
        default="sharded",
        choices=("full", "sharded"),
        help="parameter route of the replicated layout (host-sharded always gathers)",
    )
    sc.add_argument("--total-gpus", default=",".join(map(str, SCALING_GPUS)), help="comma-separated GPU counts")
    ca = sub.add_parser("calibrate", help="measure this machine and write its profile JSON")
    ca.add_argument("--out", default="this_machine.json", help="profile JSON to write")
    ca.add_argument("--ranks", type=int, default=2, help="CPU ranks measured at once")
    ca.add_argument(
        "--model",
        default="qwen3-tiny",
        help="model whose shapes the compute is measured on: a shipped name, a config JSON or a checkpoint directory",
    )
    ca.add_argument("--seq", type=int, default=26, help="sequence length of the compute measurement")
    ca.add_argument(
        "--precision",
        default="32-true",
        choices=PRECISIONS,
        help="the precision the compute is timed in; the profile then predicts steps of that precision only",
    )
    ca.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="also probe the loopback network between this many "
        "co-located hosts of --ranks ranks (default 1: no network)",
    )
    ca.add_argument(
        "--state-dir",
        help="also measure the disk of a state file in this directory (StateOnDisk), reads and writes at once",
    )
    lo = sub.add_parser("loop", help="add the training loop's time per step, measured from a traced run, to a profile")
    lo.add_argument("--profile", required=True, help="profile JSON from calibrate (rewritten unless --out)")
    lo.add_argument("--trace", required=True, help="trace_dir of a training run on this machine (a few steps)")
    lo.add_argument(
        "--tokens", type=int, required=True, help="tokens per rank and step of the traced run (batch x seq)"
    )
    lo.add_argument("--hosts", type=int, default=1, help="hosts the traced run's ranks were spread over (default 1)")
    lo.add_argument("--out", default=None, help="profile JSON to write (default: --profile)")
    dk = sub.add_parser(
        "disk", help="set a profile's disk_gbps to the rate a traced run with its state on disk got from the disk"
    )
    dk.add_argument("--profile", required=True, help="profile JSON (rewritten unless --out)")
    dk.add_argument("--trace", required=True, help="trace_dir of a training run with StateOnDisk on this machine")
    dk.add_argument("--out", default=None, help="profile JSON to write (default: --profile)")
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
            cfg = StepConfig(
                load_config(args.model),
                args.batch,
                args.seq,
                args.gpus,
                args.param_route,
                args.grad_route,
                args.chunk_bytes,
                args.prefetch_window,
                args.activation,
                args.precision,
                args.hosts,
                args.host_layout,
                args.max_units_in_flight,
                args.loss_sync,
                optimizer_state=args.optimizer_state,
                bf16_copy=not args.no_bf16_copy,
                state_on_disk=args.state_on_disk,
                master_on_disk=args.master_on_disk,
            )
            print(predict_table(cfg, args.hardware, args.network))
        elif args.cmd == "scaling":
            try:
                totals = tuple(int(x) for x in args.total_gpus.split(","))
            except ValueError:
                raise ValueError(f"--total-gpus must be comma-separated integers, got {args.total_gpus!r}") from None
            if any(t < 1 for t in totals):
                raise ValueError(f"--total-gpus must be positive, got {args.total_gpus!r}")
            profile = resolve_profile(args.hardware, args.network)
            base = StepConfig(
                load_config(args.model),
                args.batch,
                args.seq,
                args.gpus,
                args.param_route,
                args.grad_route,
                args.chunk_bytes,
                args.prefetch_window,
                args.activation,
                args.precision,
                max_units_in_flight=args.max_units_in_flight,
                loss_sync=args.loss_sync,
                optimizer_state=args.optimizer_state,
                bf16_copy=not args.no_bf16_copy,
                state_on_disk=args.state_on_disk,
                master_on_disk=args.master_on_disk,
            )
            print(scaling_table(base, profile, totals))
        elif args.cmd == "loop":
            from slidedp_lightning.steptime.calibrate import with_loop

            profile = with_loop(load_profile(args.profile), args.trace, args.tokens, args.hosts)
            out = args.out or args.profile
            with open(out, "w") as f:
                json.dump(profile.to_json(), f, indent=1)
            print(
                f"{out}: loop_overhead_s = {profile.loop_overhead * 1e3:.1f} ms ({profile.sources['loop_overhead_s']})"
            )
        elif args.cmd == "disk":
            from slidedp_lightning.steptime.calibrate import with_disk

            profile = with_disk(load_profile(args.profile), args.trace)
            out = args.out or args.profile
            with open(out, "w") as f:
                json.dump(profile.to_json(), f, indent=1)
            print(f"{out}: disk_gbps = {profile.values['disk_gbps']:.2f} ({profile.sources['disk_gbps']})")
        else:
            from slidedp_lightning.steptime.calibrate import build_profile, measure, measure_disk, measure_network

            if args.hosts < 1:
                raise ValueError(f"--hosts must be >= 1, got {args.hosts}")
            raw = measure(args.ranks, args.model, args.seq, args.precision)
            net = measure_network(args.hosts, args.ranks) if args.hosts > 1 else None
            disk = measure_disk(args.state_dir) if args.state_dir else None
            profile = build_profile(raw, args.ranks, args.model, args.seq, net, disk)
            with open(args.out, "w") as f:
                json.dump(profile.to_json(), f, indent=1)
            print(f"wrote {args.out}")
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
