"""Exit soak: N consecutive 2-rank SlideDP jobs, each with a collective right before teardown, counting how they end.

Each job is ``tests/integration/reliability_job.py`` (2 CPU ranks, a tiny Qwen3, 3 steps, an all-reduce and a
barrier in ``on_train_end``). A job counts as clean when it exits 0, every rank wrote its done marker and no output
says "terminate called" (the abort at interpreter exit the strategy's teardown prevents). ``--load K`` runs K busy
processes beside the jobs (CPU contention changes the timing of the collective backends' threads at exit).

Usage: ``python experiments/soak_exit.py [--jobs N] [--load K] [--out DIR] [--keep-groups]``; ``--keep-groups``
leaves the process groups alive at teardown (the behaviour before the fix), for comparison. Writes
``DIR/summary.json`` and prints one line per job.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "integration" / "reliability_job.py"
LAUNCH_VARS = ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
ABORT = "terminate called"


def _burn() -> None:  # pragma: no cover - runs in a load process
    x = 0
    while True:
        x = (x * 1103515245 + 12345) % 2147483648


def run_one(out: Path, keep_groups: bool, timeout: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"out": str(out), "last_collective": True, "keep_groups": keep_groups}
    (out / "config.json").write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if k not in (*LAUNCH_VARS, "MASTER_PORT")}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    started = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, str(JOB), str(out / "config.json")],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        code, output = "timeout", f"{err.stdout or ''}{err.stderr or ''}"
    (out / "output.txt").write_text(output if isinstance(output, str) else output.decode(errors="replace"))
    done = sum((out / f"done_rank{r}").exists() for r in (0, 1))
    aborts = output.count(ABORT) if isinstance(output, str) else 0
    return {"code": code, "done_ranks": done, "aborts": aborts, "seconds": round(time.monotonic() - started, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the jobs")
    parser.add_argument("--out", type=Path, default=Path("/tmp/slidedp_soak_exit"))
    parser.add_argument("--keep-groups", action="store_true", help="leave the process groups alive (before the fix)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    args = parser.parse_args(argv)
    burners = [mp.Process(target=_burn, daemon=True) for _ in range(args.load)]
    for p in burners:
        p.start()
    results = []
    started = time.monotonic()
    try:
        for i in range(args.jobs):
            r = run_one(args.out / f"job{i:03d}", args.keep_groups, args.timeout)
            results.append(r)
            clean = r["code"] == 0 and r["done_ranks"] == 2 and r["aborts"] == 0
            print(
                f"job {i:3d}: exit {r['code']}, done ranks {r['done_ranks']}, aborts {r['aborts']}, "
                f"{r['seconds']:.1f} s{'' if clean else '  <-- NOT CLEAN'}",
                flush=True,
            )
    finally:
        for p in burners:
            p.terminate()
            p.join()
    codes = collections.Counter(str(r["code"]) for r in results)
    summary = {
        "jobs": len(results),
        "load_processes": args.load,
        "keep_groups": args.keep_groups,
        "exit_codes": dict(codes),
        "clean": sum(r["code"] == 0 and r["done_ranks"] == 2 and r["aborts"] == 0 for r in results),
        "with_abort_message": sum(r["aborts"] > 0 for r in results),
        "seconds": round(time.monotonic() - started, 1),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps({**summary, "runs": results}, indent=1))
    print(json.dumps(summary))
    return 0 if summary["clean"] == summary["jobs"] else 1


if __name__ == "__main__":
    sys.exit(main())
