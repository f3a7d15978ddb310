"""Parent side of a benchmark job: preflight, subprocess with a timeout, host-memory sampling, results.

A job that cannot run is reported, never dropped: ``infeasible`` (the preflight estimate exceeds the memory
there is; the estimate and the limit are in the reason), ``oom`` (sampled host memory crossed the limit and the
job was stopped, or the job failed while the kernel's OOM killer killed a process: memory ran out between two
samples), ``timeout``, ``failed`` (the last lines of its output are the reason), ``not installed`` (the system needs
a package of the ``bench`` extra; the reason names it), ``interrupted`` (the benchmark was stopped while the job
ran). No process of a job outlives it (``bench/baselines/lifetime.py``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.baselines import extensions, lifetime
from bench.baselines.hostmem import INTERVAL_S, Sampler, mem_available
from bench.baselines.workload import JobSpec
from slidedp_lightning.constants import LEDGER_BYTES_PER_PARAM

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]
# Interpreter shutdown of a finished gloo job sometimes aborts: such a run counts as finished only with this
# signature and every rank's done marker, and the result says so.
EXIT_ABORT = "terminate called without an active exception"
GB = 1e9
# Fixed glibc mmap threshold for every system: large buffers are mmapped and go back to the OS when freed
# (glibc's dynamic threshold would otherwise keep freed tensors of up to 32 MiB in the heap, run-dependently).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
# systems that need a package of the optional ``bench`` extra (not a dependency of the project)
NEEDS = {"zero_offload": "deepspeed"}
BENCH_EXTRA = 'pip install -e ".[bench]"'
NOT_INSTALLED = "not installed"
# after a job's leading process exits, the other ranks get this long to finish writing before they are killed
GRACE_S = 10.0


@dataclass
class RunResult:
    """One system on one configuration."""

    name: str
    spec: JobSpec
    status: str = "ok"
    reason: str = ""
    step_s: list[float] = field(default_factory=list)  # measured steps (after warm-up): max over ranks
    losses: list[float] = field(default_factory=list)  # every step: mean over ranks of the local loss
    host_peak: int = 0  # PSS sum over the job's processes, peak during the training steps
    host_peak_run: int = 0  # the same over the whole job (start-up, model build and load included)
    host_peak_shmem: int = 0  # Pss_Shmem part of the training-step peak sample
    rss_sum_peak: int = 0  # plain RSS sum at the training-step peak sample (shared pages once per process)
    # sum over ranks of each rank's exact peak of private memory in the training window: the kernel's RSS
    # high-water mark, reset at the first step, minus file and shared-memory RSS at the end (None: unavailable)
    private_peak: int | None = None
    # SlideDP and its replicated mode: the memory the job's ledgers hold after the training steps, from the
    # engines' ledger_stats() (pages allocated in each ledger file, every file counted once; None: no ledger)
    ledger_host_bytes: int | None = None
    device: dict | None = None  # rank 0's device accounting (CUDA allocator, or SlideDP's runtime on CPU)
    device_note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def step_median(self) -> float:
        return statistics.median(self.step_s)

    @property
    def tokens_per_s(self) -> float:
        return self.spec.tokens_per_step / self.step_median

    def summary(self) -> dict:
        d = {
            k: getattr(self, k)
            for k in (
                "name",
                "status",
                "reason",
                "step_s",
                "losses",
                "host_peak",
                "host_peak_run",
                "host_peak_shmem",
                "rss_sum_peak",
                "private_peak",
                "ledger_host_bytes",
                "device",
                "device_note",
                "extra",
            )
        }
        d["spec"] = json.loads(self.spec.to_json())
        if self.ok:
            d |= {"step_median_s": self.step_median, "tokens_per_s": self.tokens_per_s}
        return d


def estimate_host_bytes(spec: JobSpec) -> int:
    """A coarse upper estimate of the job's peak host memory (for the preflight only, never reported as a
    measurement): bytes/param of the states each system keeps on the host at once, plus ~1.5 GB per rank."""
    n, r = spec.model.num_params, spec.ranks
    model = 4 * n * r  # every rank builds the FP32 model and loads the initial weights (mmapped file)
    per_system = {
        "slidedp": LEDGER_BYTES_PER_PARAM * n,
        "replicated": LEDGER_BYTES_PER_PARAM * n * r,
        "ddp": 12 * n * r,
        "fsdp2": 16 * n,
        "fsdp2_offload": 16 * n,
        "zero_offload": 4 * n * r + 16 * n,
    }
    if spec.accelerator == "cuda":
        model = 4 * n * r if spec.system in ("slidedp", "replicated") else 4 * n * r
        per_system["ddp"] = per_system["fsdp2"] = 0
    return model + per_system[spec.system] + int(1.5 * GB) * r


def missing_package(spec: JobSpec) -> str:
    """Why ``spec``'s system cannot run in this environment ("" when it can): a package of the bench extra."""
    module = NEEDS.get(spec.system)
    if module is None or importlib.util.find_spec(module) is not None:
        return ""
    return f"{NOT_INSTALLED}: {spec.system} needs {module}, which is not installed ({BENCH_EXTRA})"


def _launch_env(spec: JobSpec) -> dict[str, str]:
    cores = os.cpu_count() or 1
    env = {
        **os.environ,
        **MALLOC_ENV,
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": str(max(1, cores // spec.ranks)),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(REPO),
        lifetime.PARENT_ENV: str(os.getpid()),  # the job dies with this process (bench/baselines/lifetime.py)
        "TORCH_EXTENSIONS_DIR": str(extensions.owned_dir()),  # DeepSpeed's ops, built up front (bench/prepare.py)
    }
    if spec.system == "zero_offload" and spec.accelerator == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    return env


def oom_kills() -> int | None:
    """Processes the kernel's OOM killer has killed since boot (``oom_kill`` of /proc/vmstat; None where unreadable)."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def run_job(
    runs: list[tuple[str, JobSpec]],
    out: Path,
    mem_limit: int | None = None,
    interval: float = INTERVAL_S,
    preflight: bool = True,
) -> list[RunResult]:
    """Run ``runs`` (one system, one after the other in the same R processes) and collect their results.

    ``preflight=False``: no estimate refuses the job; only the sampled memory (``mem_limit``) stops it."""
    out.mkdir(parents=True, exist_ok=True)
    first = runs[0][1]
    missing = missing_package(first)
    if missing:
        return [RunResult(name, spec, NOT_INSTALLED, missing) for name, spec in runs]
    limit = mem_limit if mem_limit is not None else int(mem_available() * 0.9)
    need = max(estimate_host_bytes(s) for _, s in runs)
    if preflight and need > limit:
        why = (
            f"infeasible: the preflight estimate of host memory is {need / GB:.1f} GB "
            f"(states and per-rank models of {first.model.num_params / 1e6:.0f} M params x {first.ranks} ranks), "
            f"the limit is {limit / GB:.1f} GB (90 % of MemAvailable)"
        )
        return [RunResult(name, spec, "infeasible", why) for name, spec in runs]
    cfg = out / "config.json"
    cfg.write_text(
        json.dumps({"out": str(out), "runs": [{"name": n, "spec": json.loads(s.to_json())} for n, s in runs]})
    )
    builds = extensions.OwnedBuildDir() if first.system in NEEDS else None
    if builds is not None:  # DeepSpeed loads its ops under the benchmark's build directory: hold it meanwhile
        try:
            builds.acquire(timeout_s=first.timeout_s)
        except TimeoutError as exc:
            return [RunResult(name, spec, "timeout", f"timeout: {exc}; not started") for name, spec in runs]
    logf = open(out / "output.log", "w")  # noqa: SIM115
    kills_before = oom_kills()
    t0 = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.baselines.job", str(cfg)],
        cwd=REPO,
        env=_launch_env(first),
        stdout=logf,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    lifetime.track(proc.pid)  # the job's process group: its ranks and whatever they start
    killed: list[str] = []

    def kill(why: str) -> None:
        killed.append(why)
        lifetime.kill_group(proc.pid)

    sampler = Sampler(
        proc.pid,
        interval,
        limit,
        lambda s: kill(
            f"oom: the job's host memory (PSS sum) reached {s.pss / GB:.2f} GB, over the "
            f"limit of {limit / GB:.1f} GB; stopped"
        ),
    )
    sampler.start()
    timeout = sum(s.timeout_s for _, s in runs)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(f"timeout: still running after {timeout:.0f} s; stopped")
        proc.wait()
    except BaseException:  # KeyboardInterrupt, SIGTERM turned into one (bench/conftest.py): the job goes too
        kill("interrupted: the benchmark was stopped")
        proc.wait()
        raise
    finally:
        # ranks that outlive the leading process get a moment to write their results, then are killed
        lifetime.end_group(proc.pid, 0.0 if killed else GRACE_S)
        sampler.stop()
        logf.close()
        stale = builds.clear_stale() if builds is not None else []
        if builds is not None:
            builds.release()
        if stale:
            log.warning("removed build locks left by the job: %s", ", ".join(x.describe() for x in stale))
    wall = time.time() - t0
    output = (out / "output.log").read_text(errors="replace")
    ranks = first.ranks
    finished = all((out / f"done_rank{r}").exists() for r in range(ranks))
    status, reason = "ok", ""
    if killed:
        status, reason = killed[0].split(":", 1)[0], killed[0]
    elif proc.returncode != 0:
        if finished and proc.returncode == -signal.SIGABRT and output.rstrip().endswith(EXIT_ABORT):
            reason = f"finished on every rank, then aborted at interpreter exit ({EXIT_ABORT!r})"
        else:
            status = "failed"
            reason = f"exit code {proc.returncode}: " + " | ".join(output.strip().splitlines()[-6:])[-1500:]
            kills = oom_kills()
            if kills_before is not None and kills is not None and kills > kills_before:
                # memory ran out between two of the watchdog's samples: a model that does not fit, as above
                peak = sampler.peak()
                status = "oom"
                reason = (
                    f"oom: the kernel's OOM killer stopped {kills - kills_before} process(es) while the job ran "
                    f"(last sampled PSS {peak.pss / GB if peak else 0:.2f} GB, limit {limit / GB:.1f} GB); {reason}"
                )
    results = []
    for name, spec in runs:
        res = RunResult(name, spec, status, reason)
        res.extra["job_wall_s"] = wall
        if status == "ok":
            _collect(res, out / name, sampler)
        elif status == "failed" and (out / name / "result_rank0.json").exists():
            _collect(res, out / name, sampler)  # this run finished on every rank before the job failed
            if res.step_s:
                res.status, res.reason = "ok", f"completed; a later run of the same job failed ({reason[:200]})"

        trace = out / name / "trace" / "trace_rank0.json"
        if trace.exists():
            res.extra["lane_trace"] = str(trace)
        if stale:
            res.extra["stale_build_locks"] = [str(x.path) for x in stale]
        results.append(res)
        (out / name).mkdir(parents=True, exist_ok=True)
        (out / name / "summary.json").write_text(json.dumps(res.summary(), indent=1))
    return results


def _collect(res: RunResult, folder: Path, sampler: Sampler) -> None:
    spec = res.spec
    files = [folder / f"result_rank{r}.json" for r in range(spec.ranks)]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        res.status, res.reason = "failed", f"no result from {missing}"
        return
    per = [json.loads(f.read_text()) for f in files]
    n = spec.steps
    if any(len(p["starts"]) != n or len(p["losses"]) != n or len(p["tokens"]) != n for p in per):
        res.status, res.reason = "failed", f"ranks recorded {[len(p['starts']) for p in per]} steps, expected {n}"
        return
    # step i lasts from its start to the next step's start; the last step has no successor and is not measured
    res.step_s = [max(p["starts"][i + 1] - p["starts"][i] for p in per) for i in range(spec.warmup, n - 1)]
    res.losses = [sum(p["losses"][i] for p in per) / len(per) for i in range(n)]
    res.extra["tokens"] = [[p["tokens"][i] for p in per] for i in range(n)]
    start, end = min(p["walls"][0] for p in per), max(p["end_wall"] for p in per)
    train, whole = sampler.peak(start, end), sampler.peak()
    res.extra["host_sample_longest_wait_s"] = sampler.longest_wait_s
    if train is not None:
        res.host_peak, res.host_peak_shmem, res.rss_sum_peak = train.pss, train.pss_shmem, train.rss
    res.host_peak_run = whole.pss if whole is not None else 0
    peaks = [p.get("private_peak_bytes") for p in per]
    res.private_peak = sum(peaks) if all(v is not None for v in peaks) else None
    res.device, res.device_note = per[0]["device_memory"], per[0]["device_note"]
    res.extra.update({k: v for k, v in per[0].items() if k in ("adamw", "optimizer")})
    for key in ("load_s", "save_s", "export_s"):  # the slowest rank's time of each phase a job timed
        times = [p[key] for p in per if key in p]
        if times:
            res.extra[key] = max(times)
    ledgers = [p["ledger"] for p in per if "ledger" in p]
    if ledgers:
        res.extra["ledger_bytes"] = ledgers[0]["nbytes"]  # the size of one ledger file
        res.ledger_host_bytes = sum(led["allocated_bytes"] for led in ledgers if led["counted"])
    res.extra["train_wall_s"] = end - start
