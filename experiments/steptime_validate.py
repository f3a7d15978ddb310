"""Hold the step-time model against real 2-rank CPU SlideDP runs on this machine.

Per model, runs ``calibrate --model`` on it (or reuses ``--profile``) and one traced reference job (a batch
size and routes that none of the configurations below uses) whose lane traces give the training loop's time per
step (``steptime loop``), then each configuration below as a traced ``slidedp-finetune`` job in a subprocess, and
prints predicted vs measured median step time (a whole iteration: first forward to the next step's) and the
bottleneck labels (model vs lane traces), with the exposed time (iteration less compute) and compute stall; with the
state on disk, each job's prediction again with the disk at the rate that job got from it (``steptime disk``).

Two models: the recipe's tiny Qwen3 (compute-bound here) and ``wide``, a random-init Qwen3 with a large
untied vocabulary and one small block, written with ``save_pretrained`` into the output folder (nothing is
downloaded): 17 M parameters, almost all in the embedding and head, against 26 tokens per rank, so the host
lanes (copies, gloo collectives, the update) outweigh the compute.

    python experiments/steptime_validate.py [--profile this_machine.json] [--steps 14] [--out DIR]
        [--state-on-disk [--master-on-disk]]

``--state-on-disk``: the ``wide`` model's configurations with the Adam moments in a state file in ``<out>/state``
(``slidedp-finetune --state-dir``; calibrated with ``calibrate --state-dir``). ``--master-on-disk``: the FP32
master there too (``--master-on-disk``), so under ``bf16-mixed`` (the devices read the BF16 copy), calibrated with
``calibrate --precision bf16-mixed``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from slidedp_lightning.steptime.calibrate import with_disk, with_loop
from slidedp_lightning.steptime.graph import StepConfig
from slidedp_lightning.steptime.profiles import load_profile
from slidedp_lightning.steptime.simulate import simulate
from slidedp_lightning.steptime.traces import measured, other_threads_cpu
from slidedp_lightning.steptime.workload import load_config

SEQ = 26  # the recipe's synthetic task: 2 x 12 symbols + BOS + SEP
CONFIGS = [  # (model, per-rank batch, param_route, grad_route)
    ("tiny", 32, "full", "gpu_reduce"),
    ("tiny", 8, "full", "host_reduce"),
    ("tiny", 64, "sharded", "gpu_reduce"),
    ("tiny", 16, "replicated", "gpu_reduce"),
    ("wide", 1, "full", "gpu_reduce"),
    ("wide", 1, "replicated", "gpu_reduce"),
    ("wide", 1, "full", "host_reduce"),
]
# the same host-bound model with the Adam moments in a state file on disk (--state-dir; the profile's disk_gbps
# from calibrate --state-dir): its updates also read and write them there
DISK_CONFIGS = [
    ("wide", 1, "full", "gpu_reduce"),
    ("wide", 1, "full", "host_reduce"),
    ("wide", 2, "sharded", "gpu_reduce"),
]
# per model, the reference job that measures the training loop (batch, param_route, grad_route): none of CONFIGS
REFERENCE = {"tiny": (24, "full", "gpu_reduce"), "wide": (2, "sharded", "gpu_reduce")}
# The host-bound model: Qwen3 shapes, vocabulary 32768 (untied head), hidden 256, one block.
WIDE = dict(
    vocab_size=32768,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    use_cache=False,
    bos_token_id=1,
    eos_token_id=3,
    pad_token_id=0,
)


def write_wide_model(path: Path) -> Path:
    """Random-init the host-bound model and save it as a local Hugging Face checkpoint directory."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(Qwen3Config(**WIDE)).save_pretrained(path)
    return path


JOB_AS_MODELLED = ("--activation-policy", "none", "--chunked-loss", "0")


def run_job(
    model_dir: str | None,
    batch: int,
    param: str,
    grad: str,
    steps: int,
    trace_dir: str,
    timeout: float,
    state_dir: str | None = None,
    precision: str = "32-true",
    master_on_disk: bool = False,
) -> None:
    exe = Path(sys.executable).with_name("slidedp-finetune")
    cmd = [
        str(exe),
        "--devices",
        "2",
        "--precision",
        precision,
        "--max-steps",
        str(steps),
        "--batch-size",
        str(batch),
        "--param-route",
        param,
        "--grad-route",
        grad,
        "--trace-dir",
        trace_dir,
        "--log-dir",
        os.path.join(trace_dir, "logs"),
    ]
    if model_dir:  # the job the model simulates: no recomputation and the model's own loss, not a real model's
        # defaults (full recomputation, the loss in chunks), which the StepConfig below does not describe
        cmd += ["--model", model_dir, *JOB_AS_MODELLED]
    if state_dir:
        cmd += ["--state-dir", state_dir]
    if master_on_disk:
        cmd += ["--master-on-disk"]
    done = subprocess.run(cmd, timeout=timeout, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None, help="profile JSON (default: run calibrate first)")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--out", default=None, help="folder for the traces (default: a temporary one)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per job")
    ap.add_argument("--only", default=None, choices=("tiny", "wide"), help="run the configurations of one model only")
    ap.add_argument(
        "--state-on-disk",
        action="store_true",
        help="run the configurations with the moments on disk (DISK_CONFIGS, in <out>/state) instead",
    )
    ap.add_argument(
        "--master-on-disk",
        action="store_true",
        help="with --state-on-disk: the FP32 master on disk too, every job and the calibration in bf16-mixed",
    )
    args = ap.parse_args()
    if args.master_on_disk and not args.state_on_disk:
        ap.error("--master-on-disk needs --state-on-disk")
    precision = "bf16-mixed" if args.master_on_disk else "32-true"
    disk_knobs = dict(precision=precision, master_on_disk=args.master_on_disk)
    out = Path(args.out or tempfile.mkdtemp(prefix="steptime-validate-"))
    out.mkdir(parents=True, exist_ok=True)
    state_dir = None
    if args.state_on_disk:
        args.only = "wide"
        state_dir = out / "state"
        state_dir.mkdir(exist_ok=True)
    wide_dir = write_wide_model(out / "wide_model")
    models = {"tiny": (None, load_config("qwen3-tiny")), "wide": (str(wide_dir), load_config(wide_dir))}
    profiles = {}
    for name, (batch, param, grad) in REFERENCE.items():
        if args.only and name != args.only:
            continue
        profile_path = args.profile
        if profile_path is None:  # calibrated on the model's own shapes, as a user would
            profile_path = str(out / f"this_machine_{name}.json")
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "slidedp_lightning.steptime",
                    "calibrate",
                    "--out",
                    profile_path,
                    "--model",
                    models[name][0] or "qwen3-tiny",
                    *(["--state-dir", str(state_dir)] if state_dir else []),
                    "--precision",
                    precision,
                ],
                check=True,
                timeout=args.timeout,
            )
        profile = load_profile(profile_path)
        trace = str(out / f"reference_{name}_b{batch}_{param}_{grad}")
        run_job(models[name][0], batch, param, grad, args.steps, trace, args.timeout, precision=precision)
        profiles[name] = with_loop(profile, trace, batch * SEQ)
        (out / f"profile_{name}.json").write_text(json.dumps(profiles[name].to_json(), indent=1))
        print(f"{name}: training loop {profiles[name].loop_overhead * 1e3:.1f} ms per step ({trace})", flush=True)
    rows = []
    for name, batch, param, grad in DISK_CONFIGS if state_dir else CONFIGS:
        if args.only and name != args.only:
            continue
        model_dir, shape = models[name]
        profile = profiles[name]
        where = ("_master" if args.master_on_disk else "_disk") if state_dir else ""
        trace = str(out / f"{name}_b{batch}_{param}_{grad}{where}")
        run_job(model_dir, batch, param, grad, args.steps, trace, args.timeout, str(state_dir) if state_dir else None,
                **disk_knobs)  # fmt: skip
        meas = measured(trace)
        # the jobs run with the engine's backpressure (2 units) and the recipe logs its loss with sync_dist=True
        step = StepConfig(shape, batch, SEQ, 2, param, grad, precision=precision, max_units_in_flight=2, loss_sync=True)
        sim = simulate(replace(step, state_on_disk=state_dir is not None, master_on_disk=args.master_on_disk), profile)
        err = (sim.step_time / meas["step_time"] - 1) * 100
        job_disk = {}
        if state_dir:  # again with the disk as this job got it (steptime disk): the error of the rest of the model
            own = with_disk(profile, trace)
            again = simulate(replace(step, state_on_disk=True, master_on_disk=args.master_on_disk), own)
            job_disk = dict(
                job_disk_gbps=own.values["disk_gbps"],
                predicted_ms_job_disk=again.step_time * 1e3,
                error_pct_job_disk=(again.step_time / meas["step_time"] - 1) * 100,
                predicted_label_job_disk=again.bottleneck,
            )
        rows.append(
            dict(
                model=name,
                batch=batch,
                param_route=param,
                grad_route=grad,
                predicted_ms=sim.step_time * 1e3,
                measured_ms=meas["step_time"] * 1e3,
                window_ms=meas["window"] * 1e3,
                other_threads_cpu_ms=(other_threads_cpu(trace) or float("nan")) * 1e3,
                p25_ms=meas["p25"] * 1e3,
                p75_ms=meas["p75"] * 1e3,
                error_pct=err,
                predicted_label=sim.bottleneck,
                traced_label=meas["bottleneck"],
                predicted_exposed_ms=(sim.step_time - sim.busy["compute"]) * 1e3,
                traced_exposed_host_ms=meas["exposed_host"] * 1e3,
                traced_stall_ms=meas["stall"] * 1e3,
                traced_busy_ms={k: v * 1e3 for k, v in meas["busy"].items()},
                predicted_busy_ms={k: v * 1e3 for k, v in sim.busy.items()},
                **job_disk,
            )
        )
    print(
        f"{'model':5s} {'batch':>5s} {'params':>10s} {'grads':>11s} {'pred ms':>8s} {'meas ms':>8s} {'p25-p75':>13s} "
        f"{'err %':>6s}  {'model label':19s} {'traced label':19s} {'exp pred':>8s} {'exp meas':>8s} {'stall':>6s}"
    )
    for r in rows:
        print(
            f"{r['model']:5s} {r['batch']:5d} {r['param_route']:>10s} {r['grad_route']:>11s} {r['predicted_ms']:8.1f} "
            f"{r['measured_ms']:8.1f} {r['p25_ms']:6.1f}-{r['p75_ms']:6.1f} {r['error_pct']:+6.1f}  "
            f"{r['predicted_label']:19s} {r['traced_label']:19s} {r['predicted_exposed_ms']:8.1f} "
            f"{r['traced_exposed_host_ms']:8.1f} {r['traced_stall_ms']:6.1f}"
        )
    for r in rows:
        if "job_disk_gbps" in r:
            print(
                f"{r['model']} {r['param_route']}/{r['grad_route']}: with the disk at the {r['job_disk_gbps']:.2f} GB/s "
                f"the job got from it (probe: {profiles[r['model']].values['disk_gbps']:.2f}): predicted "
                f"{r['predicted_ms_job_disk']:.1f} ms ({r['error_pct_job_disk']:+.1f} %, {r['predicted_label_job_disk']})"
            )
    agree = sum(r["predicted_label"] == r["traced_label"] for r in rows)
    host = [r for r in rows if r["traced_label"] != "gpu-bound"]
    print(
        f"labels agree: {agree}/{len(rows)}; host-bound by the traces: {len(host)} "
        f"(model says host-bound for {sum(r['predicted_label'] != 'gpu-bound' for r in host)} of them)"
    )
    (out / "validation.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
