"""Hold the step-time model against real 2-rank CPU SlideDP runs on this machine.

Runs ``calibrate`` (or reuses ``--profile``), then each configuration below as a traced
``slidedp-finetune`` job in a subprocess, and prints predicted vs measured median step time and the
bottleneck labels (model vs lane traces).

    python experiments/steptime_validate.py [--profile this_machine.json] [--steps 14] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from slidedp_lightning.steptime.graph import StepConfig
from slidedp_lightning.steptime.profiles import load_profile
from slidedp_lightning.steptime.simulate import simulate
from slidedp_lightning.steptime.traces import measured
from slidedp_lightning.steptime.workload import load_config

SEQ = 26  # the recipe's synthetic task: 2 x 12 symbols + BOS + SEP
CONFIGS = [  # (per-rank batch, param_route, grad_route)
    (32, "full", "gpu_reduce"),
    (8, "full", "host_reduce"),
    (64, "sharded", "gpu_reduce"),
    (16, "replicated", "gpu_reduce"),
]


def run_job(batch: int, param: str, grad: str, steps: int, trace_dir: str, timeout: float) -> None:
    exe = Path(sys.executable).with_name("slidedp-finetune")
    cmd = [str(exe), "--devices", "2", "--precision", "32-true", "--max-steps", str(steps), "--batch-size", str(batch),
           "--param-route", param, "--grad-route", grad, "--trace-dir", trace_dir, "--log-dir",
           os.path.join(trace_dir, "logs")]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=timeout, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None, help="profile JSON (default: run calibrate first)")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--out", default=None, help="folder for the traces (default: a temporary one)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per job")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="steptime-validate-"))
    out.mkdir(parents=True, exist_ok=True)
    profile_path = args.profile
    if profile_path is None:
        profile_path = str(out / "this_machine.json")
        subprocess.run([sys.executable, "-m", "slidedp_lightning.steptime", "calibrate", "--out", profile_path], check=True,
                       timeout=args.timeout)  # fmt: skip
    profile = load_profile(profile_path)
    model = load_config("qwen3-tiny")
    rows = []
    for batch, param, grad in CONFIGS:
        trace = str(out / f"b{batch}_{param}_{grad}")
        run_job(batch, param, grad, args.steps, trace, args.timeout)
        meas = measured(trace)
        sim = simulate(StepConfig(model, batch, SEQ, 2, param, grad, precision="32-true"), profile)
        err = (sim.step_time / meas["step_time"] - 1) * 100
        rows.append(dict(batch=batch, param_route=param, grad_route=grad, predicted_ms=sim.step_time * 1e3,
                         measured_ms=meas["step_time"] * 1e3, error_pct=err, predicted_label=sim.bottleneck,
                         traced_label=meas["bottleneck"]))  # fmt: skip
    print(f"{'batch':>5s} {'params':>10s} {'grads':>11s} {'pred ms':>8s} {'meas ms':>8s} {'err %':>6s}  {'model':18s} traces")
    for r in rows:
        print(f"{r['batch']:5d} {r['param_route']:>10s} {r['grad_route']:>11s} {r['predicted_ms']:8.1f} "
              f"{r['measured_ms']:8.1f} {r['error_pct']:+6.1f}  {r['predicted_label']:18s} {r['traced_label']}")
    (out / "validation.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
