"""One benchmark job: ``python -m bench.baselines.job CONFIG.json``.

CONFIG: ``{"out": DIR, "runs": [{"name": ..., "spec": JobSpec}, ...]}``; every run executes in the same R
processes, one after the other (outputs under ``DIR/<name>``). Lightning systems launch their own ranks; for
FSDP2 and DeepSpeed this process starts ranks 1..R-1 (torchrun's environment variables) and becomes rank 0.
Each rank writes ``result_rank{r}.json`` per run and ``done_rank{r}`` as its very last statement. Every process
of a job dies with its parent (``bench/baselines/lifetime.py``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

PLAIN = ("fsdp2", "fsdp2_offload", "zero_offload")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_plain(ranks: int) -> tuple[int, list[subprocess.Popen]]:
    """Start ranks 1..R-1 of a non-Lightning system; return this process's rank and the children."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"]), []
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(ranks)}
    os.environ.update(env, RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(ranks))
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.baselines.job", *sys.argv[1:]],
            env={**os.environ, **env, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(1, ranks)
    ]
    return 0, children


def main(path: str) -> int:
    import torch

    cfg = json.loads(Path(path).read_text())
    from bench.baselines.workload import JobSpec

    runs = [(r["name"], JobSpec.from_dict(r["spec"])) for r in cfg["runs"]]
    first = runs[0][1]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, children = 0, []
    if first.system in PLAIN:
        import torch.distributed as dist

        rank, children = _launch_plain(first.ranks)
        if first.accelerator == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        if first.system == "zero_offload":
            import deepspeed

            deepspeed.init_distributed(dist_backend="nccl" if first.accelerator == "cuda" else "gloo")
        else:
            dist.init_process_group("nccl" if first.accelerator == "cuda" else "gloo")
    for name, spec in runs:
        out = os.path.join(cfg["out"], name)
        os.makedirs(out, exist_ok=True)
        if spec.system in ("slidedp", "replicated"):
            from bench.baselines import slidedp

            rank = slidedp.run(spec, out)
        elif spec.system == "ddp":
            from bench.baselines import ddp

            rank = ddp.run(spec, out)
        elif spec.system in ("fsdp2", "fsdp2_offload"):
            from bench.baselines import fsdp2

            fsdp2.run(spec, out, rank)
        else:
            from bench.baselines import zero_offload

            zero_offload.run(spec, out, rank)
    # leave no gloo threads to static destructors at interpreter exit (they can abort the process)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    bad = [c.wait() for c in children]
    # the very last statement: this rank ran main() to the end (see runner.EXIT_ABORT)
    Path(cfg["out"], f"done_rank{rank}").write_text("ok\n")
    return 1 if any(bad) else 0


if __name__ == "__main__":
    from bench.baselines.lifetime import die_with_parent

    die_with_parent()  # first: a benchmark killed with SIGKILL takes this rank down with it
    sys.exit(main(sys.argv[1]))
