"""The capacity job with its state on disk, against the step-time model's prediction for it.

``python experiments/capacity_steptime.py --profile P.json --layers 44 [--master-on-disk] [--steps 6] [--trace]
[--checkpoints DIR] [--out DIR]``

Runs ``bench.capacity``'s SlideDP job with the moments (``slidedp_disk``) or the FP32 master and int8 moments
(``--master-on-disk``: ``slidedp_disk_master``) in a state file, at the depth given, for ``--steps`` steps without the
checkpoint save and the export, under the same host-memory watchdog; then predicts its step from a profile calibrated
on the same shapes, e.g. ``python -m slidedp_lightning.steptime calibrate --model L2.json --seq 32 --precision
bf16-mixed --state-dir DIR`` with a 2-layer config of the shape. Prints measured (median, range, after one warm-up
step) against predicted, the model's limiting resource, and writes ``summary.json`` under ``--out``. With ``--trace``
the job records its lanes (:class:`slidedp_lightning.LaneTrace`) and each lane's busy seconds a step (rank 0, median
after the warm-up) are printed beside the model's: where the prediction is short, which lane it underestimates;
and the prediction again with the disk at the rate the job got from it (``steptime disk``), which leaves the error of
the rest of the model.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.baselines.runner import GB, run_job  # noqa: E402
from bench.baselines.sharded_checkpoint import ShardedCheckpoints  # noqa: E402
from bench.capacity import PRECISION, QWEN3_1_7B, RANKS, SEQ, SYSTEMS, spec_for  # noqa: E402
from slidedp_lightning.steptime.calibrate import with_disk  # noqa: E402
from slidedp_lightning.steptime.graph import LANES, StepConfig  # noqa: E402
from slidedp_lightning.steptime.profiles import Profile, load_profile  # noqa: E402
from slidedp_lightning.steptime.simulate import SimResult, simulate  # noqa: E402
from slidedp_lightning.steptime.traces import measured  # noqa: E402
from slidedp_lightning.steptime.workload import load_config  # noqa: E402


def predicted(label: str, checkpoint: Path, profile: str | Profile) -> SimResult:
    """The model's steady step of ``label``'s job on ``checkpoint``'s shapes: its time, bottleneck and lanes' busy."""
    knobs = SYSTEMS[label][1]
    cfg = StepConfig(
        load_config(str(checkpoint)),
        batch=1,  # the capacity job's global batch is one sequence a rank
        seq=SEQ,
        gpus=RANKS,
        activation="full",
        precision=PRECISION,
        max_units_in_flight=2,
        optimizer_state=knobs.get("optimizer_state", "fp32"),
        bf16_copy=knobs.get("bf16_copy", True),
        state_on_disk=True,
        master_on_disk=knobs.get("master_on_disk", False),
    )
    return simulate(cfg, profile if isinstance(profile, Profile) else load_profile(profile))


def lane_table(traced: dict[str, float], model: dict[str, float]) -> list[str]:
    """Markdown rows: each lane's busy seconds a step, traced against predicted (lanes both leave idle omitted)."""
    rows = ["| lane | traced s | predicted s | predicted / traced |", "|---|---|---|---|"]
    for lane in LANES:
        t, m = traced.get(lane, 0.0), model.get(lane, 0.0)
        if t or m:
            rows.append(f"| {lane} | {t:.2f} | {m:.2f} | {m / t:.2f} |" if t else f"| {lane} | 0 | {m:.2f} | - |")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", required=True, help="profile JSON from calibrate on the capacity shapes")
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--master-on-disk", action="store_true", help="the FP32 master and int8 moments on disk")
    p.add_argument("--steps", type=int, default=6, help="training steps (the first one is a warm-up)")
    p.add_argument("--checkpoints", type=Path, default=Path("results/capacity-checkpoints-qwen3-1.7b-shape"))
    p.add_argument("--out", type=Path, default=Path("results/capacity-steptime"))
    p.add_argument("--limit-gb", type=float, default=22.5, help="the host-memory watchdog's limit")
    p.add_argument("--trace", action="store_true", help="record the lanes and compare each with the model's")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.steps < 3:
        p.error("--steps must be at least 3: a warm-up step and two measured ones")

    label = "slidedp_disk_master" if args.master_on_disk else "slidedp_disk"
    checkpoint = ShardedCheckpoints(args.checkpoints, QWEN3_1_7B, SEQ).directory(args.layers)
    spec = spec_for(label, QWEN3_1_7B, args.layers, checkpoint, timeout_s=3600.0, save=False)
    spec = replace(spec, steps=args.steps, export=False)
    if args.trace:
        spec = replace(spec, knobs={**spec.knobs, "lane_trace": True})
    folder = args.out / label / f"L{args.layers}"
    (res,) = run_job([(label, spec)], folder, mem_limit=int(args.limit_gb * GB), preflight=False)
    shutil.rmtree(folder / label / "state", ignore_errors=True)  # the state file (GBs), if the job left it
    if res.status != "ok" or not res.step_s:
        print(f"{label} at {args.layers} layers: {res.status} {res.reason[:500]}", file=sys.stderr)
        return 1

    sim = predicted(label, checkpoint, args.profile)
    want, bottleneck = sim.step_time, sim.bottleneck
    got = statistics.median(res.step_s)
    summary = {
        "system": label,
        "layers": args.layers,
        "params": spec.model.num_params,
        "precision": PRECISION,
        "measured_step_s": res.step_s,
        "measured_median_s": got,
        "predicted_s": want,
        "error_pct": (want / got - 1) * 100,
        "predicted_bottleneck": bottleneck,
        "losses": res.losses,
        "host_peak_gb": res.host_peak / GB,
        "profile": args.profile,
        "predicted_busy_s": sim.busy,
    }
    if args.trace:
        traced = measured(folder / label / "trace", skip=1, ranks=RANKS)
        summary["traced"] = traced
    (folder / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"{label}, {args.layers} layers ({spec.model.num_params / 1e9:.2f} B params), {PRECISION}: measured "
        f"{got:.1f} s a step (median of {len(res.step_s)}; {min(res.step_s):.1f}-{max(res.step_s):.1f}), predicted "
        f"{want:.1f} s ({summary['error_pct']:+.1f} %, {bottleneck})"
    )
    if args.trace:
        print(
            f"traced (rank 0, median of {traced['steps']} steps): iteration {traced['step_time']:.1f} s, "
            f"{traced['bottleneck']}; the compute thread stalled {traced['stall']:.1f} s"
        )
        print("\n".join(lane_table(traced["busy"], sim.busy)))
        # the disk as this job used it, in place of the calibration's probe: what is left is the rest of the model
        own = with_disk(load_profile(args.profile), folder / label / "trace", skip=1)
        again = predicted(label, checkpoint, own)
        summary["with_traced_disk"] = {
            "disk_gbps": own.values["disk_gbps"],
            "predicted_s": again.step_time,
            "error_pct": (again.step_time / got - 1) * 100,
            "predicted_bottleneck": again.bottleneck,
        }
        (folder / "summary.json").write_text(json.dumps(summary, indent=2))
        print(
            f"with the disk at the {own.values['disk_gbps']:.2f} GB/s this job got from it (the profile's probe: "
            f"{load_profile(args.profile).values['disk_gbps']:.2f}): predicted {again.step_time:.1f} s "
            f"({summary['with_traced_disk']['error_pct']:+.1f} %, {again.bottleneck}), disk lane "
            f"{again.busy.get('disk', 0.0):.2f} s against {traced['busy'].get('disk', 0.0):.2f} s traced"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
