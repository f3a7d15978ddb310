"""One-time costs of a benchmark run, paid once, up front and outside every job's timeout, each with a progress
line: the initial weights files, the Numba kernels (compiled into Numba's cache, which the jobs then load) and
DeepSpeed's CPU Adam op (built into the benchmark's own extensions directory, see ``bench/baselines/extensions.py``).
Nothing here waits without a bound: the op build has a time limit, and a build lock in the way is named.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.baselines import extensions, lifetime
from bench.baselines.runner import BENCH_EXTRA, NOT_INSTALLED, REPO
from bench.baselines.workload import ModelShape, init_file_for

Progress = Callable[[str], None]
BUILD_TIMEOUT_S = 1200.0  # DeepSpeed's cpu_adam op: about a minute on an idle 2-core machine, more when loaded
PROGRESS_EVERY_S = 30.0
# builds the op the ZeRO-Offload jobs and the CPU update benchmark load (the process dies with its parent)
_BUILD = (
    "from bench.baselines.lifetime import die_with_parent; die_with_parent()\n"
    "import torch\n"
    "from deepspeed.ops.adam import DeepSpeedCPUAdam\n"
    "DeepSpeedCPUAdam([torch.zeros(8, requires_grad=True)])\n"
    "print('built', flush=True)\n"
)


@dataclass
class Prepared:
    """What the one-time steps found: systems that cannot run (and why), notes for the report, seconds per step."""

    blocked: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)


class WeightsCounter:
    """``init`` for :func:`bench.configs.plan`: makes (or finds) each initial weights file, counting both."""

    def __init__(self) -> None:
        self.files: set[Path] = set()
        self.made: set[Path] = set()
        self.seconds = 0.0

    @property
    def built(self) -> int:
        return len(self.made)

    @property
    def found(self) -> int:
        return len(self.files - self.made)

    def __call__(self, shape: ModelShape, seq: int, root: Path) -> Path:
        t0, wall = time.perf_counter(), time.time()
        path = init_file_for(shape, seq, root)
        self.seconds += time.perf_counter() - t0
        if path not in self.files and path.stat().st_mtime >= wall - 1.0:
            self.made.add(path)
        self.files.add(path)
        return path


def warm_kernels(ranks: int, progress: Progress) -> float:
    """Compile (or load from Numba's cache) every CPU-update kernel the jobs and the kernel suites use."""
    from cpu_ops import warmup

    progress("one-time: Numba kernels (compiled once into Numba's cache; later runs load them) ...")
    seconds = warmup(sum_rows=sorted({1, 2, 4, ranks}), adam8=True)
    progress(f"one-time: Numba kernels ready in {seconds:.1f} s")
    return seconds


def deepspeed_missing() -> str:
    if importlib.util.find_spec("deepspeed") is None:
        return f"{NOT_INSTALLED}: DeepSpeed is not installed ({BENCH_EXTRA})"
    return ""


def build_deepspeed_ops(
    accelerator: str,
    progress: Progress,
    log_path: Path,
    timeout_s: float = BUILD_TIMEOUT_S,
    root: Path | None = None,
    code: str = _BUILD,
) -> str:
    """Build DeepSpeed's CPU Adam op into the benchmark's extensions directory; "" when it is ready, else why not.

    Reports build locks in torch's default directory, removes stale ones in the benchmark's own (it holds that
    directory while building), and stops the build after ``timeout_s``."""
    root = root or extensions.owned_dir()
    note = extensions.stale_lock_note(extensions.find_locks(extensions.default_dir()), extensions.default_dir())
    if note:
        progress(f"one-time: {note}")
    owned = extensions.OwnedBuildDir(root)
    t0 = time.monotonic()
    try:
        owned.acquire(timeout_s, on_wait=lambda msg: progress(f"one-time: DeepSpeed op build: {msg}"))
    except TimeoutError as exc:
        return f"failed: DeepSpeed's op build could not start: {exc}"
    try:
        for lock in owned.clear_stale():
            progress(f"one-time: removed a stale build lock, {lock.describe()} (no build holds {root})")
        progress(f"one-time: DeepSpeed's cpu_adam op: building (or loading) in {root}; log {log_path} ...")
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "TORCH_EXTENSIONS_DIR": str(root),
            lifetime.PARENT_ENV: str(os.getpid()),
        }
        if accelerator == "cpu":
            env["DS_ACCELERATOR"] = "cpu"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-c", code], cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            lifetime.track(proc.pid)
            try:
                last = time.monotonic()
                while proc.poll() is None:
                    waited = time.monotonic() - t0
                    if waited > timeout_s:
                        lifetime.kill_group(proc.pid)
                        proc.wait()
                        return f"failed: DeepSpeed's cpu_adam op did not build in {timeout_s:.0f} s (log {log_path})"
                    if time.monotonic() - last >= PROGRESS_EVERY_S:
                        last = time.monotonic()
                        locks = "; ".join(x.describe() for x in extensions.find_locks(root))
                        progress(
                            f"one-time: DeepSpeed op build still running ({waited:.0f} s of at most {timeout_s:.0f})"
                            + (f"; build lock {locks}" if locks else "")
                        )
                    time.sleep(0.5)
            finally:
                if proc.poll() is None:
                    lifetime.kill_group(proc.pid)
                    proc.wait()
                lifetime.end_group(proc.pid)
        if proc.returncode != 0:
            tail = " | ".join(log_path.read_text(errors="replace").strip().splitlines()[-4:])[-800:]
            return f"failed: DeepSpeed's cpu_adam op build exited {proc.returncode}: {tail}"
        progress(f"one-time: DeepSpeed's cpu_adam op ready in {time.monotonic() - t0:.1f} s")
        return ""
    finally:
        owned.clear_stale()  # a build killed above leaves its lock: gone before anyone waits on it
        owned.release()


def prepare(
    accelerator: str,
    ranks: int,
    out: Path,
    progress: Progress,
    needs_deepspeed: bool,
    kernels: bool = True,
) -> Prepared:
    """The one-time steps other than the initial weights (made while planning, see :class:`WeightsCounter`)."""
    prep = Prepared()
    if kernels:
        prep.timings["one-time: Numba kernels"] = warm_kernels(ranks, progress)
    if needs_deepspeed:
        t0 = time.perf_counter()
        why = deepspeed_missing()
        if why:
            progress(f"one-time: {why}: the ZeRO-Offload rows say '{NOT_INSTALLED}'")
        else:
            why = build_deepspeed_ops(accelerator, progress, out / "one-time" / "deepspeed_build.log")
            os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions.owned_dir())  # this process loads it from there too
        if why:
            prep.blocked["zero_offload"] = why
            prep.notes.append(f"ZeRO-Offload: {why}")
        prep.timings["one-time: DeepSpeed op"] = time.perf_counter() - t0
    return prep
