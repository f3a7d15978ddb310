"""Hold the step-time model against real 2-host x 2-rank CPU SlideDP runs on this machine (gloo over loopback).

For each configuration below: wait for an idle machine, run ``calibrate --hosts 2`` on that configuration's model
(the single-host probes, the loopback "network" between the hosts and the cores they share), wait again, then run
one traced 2-node job (one launcher per "host", its own ``NODE_RANK`` and ledger, one rendezvous, as
``tests/integration/conftest.py::run_nodes`` does) and compare the predicted with the measured median step time
(slowest of the 4 ranks per step, warm-up steps excluded). Both host layouts, two models, two batch sizes. The
training loop's time per step outside the runtime's traced work (``steptime loop``) comes from one single-host
2-rank job per model, at a batch size none of the configurations uses.

The jobs train the recipe's ``FinetuneModule`` (synthetic task, 32-true) under Lightning with ``num_nodes=2``:
the recipe's tiny Qwen3 and ``mid`` (written with ``save_pretrained`` into the output folder). Both "hosts" share
this machine's cores, which the calibrated profile states (``colocated_cores``). Each job also records, per rank,
its CPU time by thread and the machine's busy time (``cpu_rank*.json``), to tell other jobs' load from its own.

    python experiments/multinode_validate.py [--profile this_machine.json] [--steps 20] [--out DIR] [--only 0,2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEQ = 26  # the recipe's synthetic task: 2 x 12 symbols + BOS + SEP
NODES, DEVICES = 2, 2
CONFIGS = [  # (model, per-rank batch, param_route, host_layout)
    ("mid", 8, "full", "replicated"),
    ("mid", 24, "full", "replicated"),
    ("mid", 8, "sharded", "sharded"),
    ("mid", 24, "sharded", "sharded"),
    ("tiny", 8, "full", "replicated"),
    ("tiny", 8, "sharded", "sharded"),
]
# "mid": the recipe's tiny Qwen3 with 2x wider blocks (0.79 M parameters per block, 3.2 M in all), random-init and
# written with save_pretrained into the output folder (nothing is downloaded)
MID = dict(
    vocab_size=64,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    use_cache=False,
    bos_token_id=1,
    eos_token_id=3,
    pad_token_id=0,
)
# the training loop's time per step is measured on one host (2 ranks, route full) at a batch none of CONFIGS uses,
# and carried to the 2 x 2 jobs by the model (it is work on the cores the co-located hosts share)
REFERENCE_BATCH = 16
MAX_UNITS_IN_FLIGHT = 2  # EngineConfig's default, which these jobs run with
LAUNCH_VARS = (
    "LOCAL_RANK",
    "NODE_RANK",
    "GLOBAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


def machine_cpu() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs of this machine so far (/proc/stat)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads so far, summed by thread name."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        key = "main" if task.name == str(os.getpid()) else name.rstrip("0123456789_-")
        out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _cpu_time_callback():
    import lightning.pytorch as L

    class CpuTime(L.Callback):
        """From step ``skip`` to the end: CPU seconds of this process (in all and by thread), wall seconds, the
        machine's busy share, and the training thread's CPU at each batch start and end."""

        def __init__(self, skip: int, out: str) -> None:
            self.skip, self.out, self.t0, self.marks = skip, out, None, []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if self.t0 is not None:
                self.marks.append(("end", thread_cpu().get("main", 0.0), time.perf_counter()))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if self.t0 is not None:
                self.marks.append(("start", thread_cpu().get("main", 0.0), time.perf_counter()))
            if batch_idx == self.skip:
                self.t0 = (time.process_time(), time.perf_counter(), batch_idx, machine_cpu(), thread_cpu())

        def on_train_end(self, trainer, pl_module) -> None:
            if self.t0 is None:
                return
            cpu, wall, first, (busy, total), threads = self.t0
            now = thread_cpu()
            steps = trainer.global_step - first
            busy2, total2 = machine_cpu()
            Path(self.out, f"cpu_rank{trainer.global_rank}.json").write_text(
                json.dumps(
                    {
                        "cpu_s": time.process_time() - cpu,
                        "wall_s": time.perf_counter() - wall,
                        "steps": steps,
                        "machine_busy": (busy2 - busy) / max(1, total2 - total),
                        "threads": {k: v - threads.get(k, 0.0) for k, v in now.items()},
                        "marks": self.marks,
                    }
                )
            )

    return CpuTime


def worker(args: argparse.Namespace) -> int:
    """One node's Lightning job (Lightning re-runs this command for the node's other local rank)."""
    import warnings

    import lightning.pytorch as L
    import torch

    from slidedp_lightning import LaneTrace, SlideDPStrategy
    from slidedp_lightning.recipes.finetune import FinetuneModule

    warnings.filterwarnings("ignore")
    CpuTime = _cpu_time_callback()
    L.seed_everything(1234, workers=True, verbose=False)
    module = FinetuneModule(model_dir=args.model_dir, batch_size=args.batch, lr=3e-3, seed=1234)
    strategy = SlideDPStrategy(param_route=args.param_route, grad_route="gpu_reduce", host_layout=args.host_layout)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=DEVICES,
        num_nodes=args.nodes,
        precision="32-true",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[CpuTime(args.skip, args.trace_dir), LaneTrace(args.trace_dir)],
    )
    trainer.fit(module)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(
    model_dir: str | None,
    batch: int,
    param: str,
    layout: str,
    steps: int,
    trace_dir: str,
    timeout: float,
    nodes: int = NODES,
) -> None:
    """``nodes`` node launchers on this machine (distinct NODE_RANK, one rendezvous); raises on failure or timeout."""
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), PYTHONWARNINGS="ignore")
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "worker",
        "--batch",
        str(batch),
        "--param-route",
        param,
        "--host-layout",
        layout,
        "--steps",
        str(steps),
        "--trace-dir",
        trace_dir,
        "--nodes",
        str(nodes),
    ]
    if model_dir:
        cmd += ["--model-dir", model_dir]
    logs = [open(os.path.join(trace_dir, f"node{n}.log"), "w") for n in range(nodes)]
    procs = [
        subprocess.Popen(
            cmd, stdout=logs[n], stderr=subprocess.STDOUT, env={**base, "NODE_RANK": str(n)}, start_new_session=True
        )
        for n in range(nodes)
    ]
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        raise RuntimeError(f"2-node job timed out after {timeout:.0f} s (logs under {trace_dir})") from None
    finally:
        for f in logs:
            f.close()
    done = all((Path(trace_dir) / f"rank{r}").is_dir() for r in range(nodes * DEVICES))
    if any(p.returncode for p in procs) and not done:
        tail = "".join((Path(trace_dir) / f"node{n}.log").read_text()[-2000:] for n in range(nodes))
        raise RuntimeError(f"{nodes}-node job failed ({[p.returncode for p in procs]}):\n{tail}")


def write_mid_model(path: Path) -> Path:
    """Random-init the "mid" model and save it as a local Hugging Face checkpoint directory."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(Qwen3Config(**MID)).save_pretrained(path)
    return path


def busy_fraction(seconds: float = 3.0) -> float:
    """Share of this machine's CPU time that was busy over the next ``seconds``."""
    b0, t0 = machine_cpu()
    time.sleep(seconds)
    b1, t1 = machine_cpu()
    return (b1 - b0) / max(1, t1 - t0)


def wait_quiet(limit_s: float, threshold: float = 0.15) -> float:
    """Wait (at most ``limit_s``) until the machine is idle: other jobs share its cores. Returns the last busy share."""
    deadline = time.monotonic() + limit_s
    busy = busy_fraction()
    while busy > threshold and time.monotonic() < deadline:
        busy = busy_fraction()
    return busy


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def foreign_cpu(trace_dir: Path, cores: int) -> float:
    """Share of the machine's cores that other processes used during the job's measured steps."""
    import cpu_ops

    ranks = [json.loads(f.read_text()) for f in sorted(trace_dir.glob("cpu_rank*.json"))]
    if not ranks:
        return float("nan")
    wall = statistics.mean(r["wall_s"] for r in ranks)
    ours = sum(r["cpu_s"] for r in ranks) / (wall * cores)
    return max(0.0, ranks[0]["machine_busy"] - ours) if cores == cpu_ops.physical_cores() else float("nan")


def calibrate(path: Path, model: str, timeout: float) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "slidedp_lightning.steptime",
            "calibrate",
            "--hosts",
            str(NODES),
            "--ranks",
            str(DEVICES),
            "--model",
            model,
            "--seq",
            str(SEQ),
            "--out",
            str(path),
        ],
        check=True,
        timeout=timeout,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    wk = sub.add_parser("worker", help=argparse.SUPPRESS)
    wk.add_argument("--model-dir", default=None)
    wk.add_argument("--batch", type=int, required=True)
    wk.add_argument("--param-route", required=True)
    wk.add_argument("--host-layout", required=True)
    wk.add_argument("--steps", type=int, required=True)
    wk.add_argument("--trace-dir", required=True)
    wk.add_argument("--skip", type=int, default=3)
    wk.add_argument("--nodes", type=int, default=NODES)
    ap.add_argument(
        "--profile", default=None, help="profile JSON with a network (default: calibrate --hosts 2 before each job)"
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the median")
    ap.add_argument("--out", default=None, help="folder for the traces (default: a temporary one)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    ap.add_argument(
        "--quiet-wait",
        type=float,
        default=120.0,
        help="seconds to wait for an idle machine before each calibration and job (other jobs share the cores)",
    )
    ap.add_argument("--only", default=None, help="comma-separated indices into CONFIGS")
    args = ap.parse_args()
    if args.cmd == "worker":
        return worker(args)

    import cpu_ops
    from slidedp_lightning.steptime.calibrate import with_loop
    from slidedp_lightning.steptime.graph import StepConfig
    from slidedp_lightning.steptime.profiles import load_profile
    from slidedp_lightning.steptime.simulate import simulate
    from slidedp_lightning.steptime.traces import measured, other_threads_cpu
    from slidedp_lightning.steptime.workload import load_config

    out = Path(args.out or tempfile.mkdtemp(prefix="multinode-validate-"))
    out.mkdir(parents=True, exist_ok=True)
    cores = cpu_ops.physical_cores()
    mid = write_mid_model(out / "mid_model")
    models = {"tiny": ("qwen3-tiny", None), "mid": (str(mid), str(mid))}  # (calibrate --model, job --model-dir)
    picks = [int(i) for i in args.only.split(",")] if args.only else range(len(CONFIGS))
    rows = []
    references: dict[str, Path] = {}
    for i in picks:
        name, batch, param, layout = CONFIGS[i]
        if name not in references:  # the training loop's time per step, from one host's 2-rank job
            ref = out / f"reference_{name}_b{REFERENCE_BATCH}_1host"
            ref.mkdir(parents=True, exist_ok=True)
            wait_quiet(args.quiet_wait)
            run_job(models[name][1], REFERENCE_BATCH, "full", "replicated", args.steps, str(ref), args.timeout, nodes=1)
            references[name] = ref
        trace = out / f"{name}_b{batch}_{param}_{layout}"
        trace.mkdir(parents=True, exist_ok=True)
        profile_path = Path(args.profile) if args.profile else trace / "this_machine.json"
        calib_model, model_dir = models[name]
        shape = load_config(calib_model)
        busy_before = wait_quiet(args.quiet_wait)
        if not args.profile:
            calibrate(profile_path, calib_model, args.timeout)
            busy_before = max(busy_before, wait_quiet(args.quiet_wait))
        load = load_average()
        run_job(model_dir, batch, param, layout, args.steps, str(trace), args.timeout)
        profile = with_loop(load_profile(profile_path), references[name], REFERENCE_BATCH * SEQ)
        (trace / "profile_with_loop.json").write_text(json.dumps(profile.to_json(), indent=1))
        meas = measured(trace, skip=args.skip, ranks=NODES * DEVICES)
        cfg = StepConfig(
            shape,
            batch,
            SEQ,
            DEVICES,
            param,
            "gpu_reduce",
            precision="32-true",
            hosts=NODES,
            host_layout=layout,
            max_units_in_flight=MAX_UNITS_IN_FLIGHT,
            loss_sync=True,
        )
        sim = simulate(cfg, profile)
        err = (sim.step_time / meas["step_time"] - 1) * 100
        other = foreign_cpu(trace, cores)
        rows.append(
            dict(
                model=name,
                batch=batch,
                param_route=param,
                host_layout=layout,
                predicted_ms=sim.step_time * 1e3,
                measured_ms=meas["step_time"] * 1e3,
                window_ms=meas["window"] * 1e3,
                other_threads_cpu_ms=(other_threads_cpu(trace) or float("nan")) * 1e3,
                p25_ms=meas["p25"] * 1e3,
                p75_ms=meas["p75"] * 1e3,
                error_pct=err,
                steps=meas["steps"],
                predicted_label=sim.bottleneck,
                traced_label=meas["bottleneck"],
                traced_busy_ms={k: v * 1e3 for k, v in meas["busy"].items()},
                predicted_busy_ms={k: v * 1e3 for k, v in sim.busy.items()},
                predicted_exposed_ms={k: v * 1e3 for k, v in sim.exposed.items()},
                traced_stall_ms=meas["stall"] * 1e3,
                load=load,
                busy_before=busy_before,
                foreign_cpu=other,
                profile=str(profile_path),
                colocated_cores=profile.values.get("colocated_cores"),
                gpu_flops=profile.gpu_flops,
            )
        )
        print(
            f"{name} b{batch} {param}/{layout}: predicted {sim.step_time * 1e3:.1f} ms, measured "
            f"{meas['step_time'] * 1e3:.1f} ms ({err:+.1f} %), load {load}, other jobs {other:.0%} of the cores",
            flush=True,
        )
    print(
        f"\n{'model':5s} {'batch':>5s} {'params':>8s} {'layout':>10s} {'pred ms':>8s} {'meas ms':>8s} {'p25-p75':>13s} "
        f"{'err %':>6s}  {'model label':19s} {'traced label':19s} {'load (1 min)':>12s} {'other jobs':>10s}"
    )
    for r in rows:
        print(
            f"{r['model']:5s} {r['batch']:5d} {r['param_route']:>8s} {r['host_layout']:>10s} {r['predicted_ms']:8.1f} "
            f"{r['measured_ms']:8.1f} {r['p25_ms']:6.1f}-{r['p75_ms']:6.1f} {r['error_pct']:+6.1f}  "
            f"{r['predicted_label']:19s} {r['traced_label']:19s} {r['load'].split()[0]:>12s} {r['foreign_cpu']:10.0%}"
        )
    within = sum(abs(r["error_pct"]) <= 25 for r in rows)
    print(
        f"within +-25 %: {within}/{len(rows)}; median |error| {statistics.median(abs(r['error_pct']) for r in rows):.1f} %"
    )
    (out / "multinode_validation.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
