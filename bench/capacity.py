"""The largest model each system fine-tunes on this host: ``python -m bench.capacity`` (or ``pytest bench/
--benchmark -k capacity``).

For every system, a search over the number of layers of Qwen3-1.7B's shape (hidden 2048, 16 query / 8 KV heads
of 128, MLP 6144, vocabulary 151,936, tied embeddings) finds the deepest model that completes the whole job on
2 CPU ranks: load a BF16 sharded safetensors checkpoint (written here, shard by shard), 3 training steps
(1 x 32 tokens per rank, full activation checkpointing), a checkpoint save and, for SlideDP, a Hugging Face export
that transformers then reloads. Every system trains in the precision this host computes fast (:data:`PRECISION`:
bf16-mixed, or 32-true on a CPU without AVX512-BF16 or AMX, where torch emulates bf16 matmuls); the table says which. Each attempt is a process tree of its own under a host-memory
watchdog (the sum of the job's PSS) below the machine's limit: a model that does not fit is a data point
("does not fit"), not a crash of the benchmark. Every row of the table comes from one run.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.baselines.runner import GB, REPO, RunResult, run_job
from bench.baselines.sharded_checkpoint import ShardedCheckpoints
from bench.baselines.workload import JobSpec, ModelShape
from slidedp_lightning.recipes.settings import default_precision

log = logging.getLogger(__name__)
PRECISION = default_precision("cpu")  # every system's, so that the rows compare

QWEN3_1_7B = ModelShape(
    name="qwen3-1.7b-shape",
    hidden=2048,
    layers=28,
    intermediate=6144,
    heads=16,
    kv_heads=8,
    head_dim=128,
    vocab=151936,
)
# a small shape of the same structure, for a quick run of the whole procedure
TINY = ModelShape(name="tiny", hidden=256, layers=4, intermediate=768, heads=4, kv_heads=2, head_dim=64, vocab=8192)

# label: (system, strategy knobs, (host GB per billion parameters, GB besides) to start the search from: SlideDP's
# ledger bytes per parameter and the rest of the job measured at this shape (6.9 GB for 2 ranks with unit copies;
# 5.6 expected where the CPU ranks compute on the ledger's BF16 copy, 1.3 GB less); FSDP2's slope and rest from its run here (14 layers fit, 16 do not), the others' slopes from
# docs/PERFORMANCE.md's systems tables)
SYSTEMS: dict[str, tuple[str, dict, tuple[float, float]]] = {
    "ddp": ("ddp", {}, (34.0, 3.0)),
    "fsdp2": ("fsdp2", {}, (15.8, 6.0)),
    "fsdp2_offload": ("fsdp2_offload", {}, (16.6, 3.0)),
    "zero_offload": ("zero_offload", {}, (24.0, 3.0)),
    "slidedp": ("slidedp", {}, (14.0, 5.6)),
    "slidedp_int8": ("slidedp", {"optimizer_state": "int8"}, (8.01, 5.6)),
    "slidedp_int8_nocopy": ("slidedp", {"optimizer_state": "int8", "bf16_copy": False}, (6.01, 6.9)),
    # FP32 moments in a state file on the disk of the output folder (8 B/param of them there, not in memory)
    "slidedp_disk": ("slidedp", {"state_on_disk": True}, (6.0, 5.6)),
    # the FP32 master and int8 moments in the state file: the BF16 copy alone in memory (2 B/param; bf16-mixed only)
    "slidedp_disk_master": (
        "slidedp",
        {"state_on_disk": True, "master_on_disk": True, "optimizer_state": "int8"},
        (2.0, 5.6),
    ),
}
RANKS, SEQ, STEPS = 2, 32, 3


@dataclass
class Attempt:
    layers: int
    params: int
    status: str  # "fits", "does not fit", or why the job failed otherwise
    result: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def fits(self) -> bool:
        return self.status == "fits"


@dataclass
class Search:
    label: str
    attempts: list[Attempt] = field(default_factory=list)
    why_not_run: str = ""  # a system this host cannot run as the others (see :func:`not_run`)

    @property
    def largest(self) -> Attempt | None:
        fitting = [a for a in self.attempts if a.fits]
        return max(fitting, key=lambda a: a.layers) if fitting else None

    def slope_gb_per_b(self) -> float | None:
        """Host GB per billion parameters between the shallowest and the deepest fitting attempts; None without two
        of them, or where the deeper one's peak is not the larger (sizes too close for the peak's noise: a slope
        that small or negative would extrapolate nonsense)."""
        fitting = sorted((a for a in self.attempts if a.fits), key=lambda a: a.layers)
        if len(fitting) < 2:
            return None
        a, b = fitting[0], fitting[-1]
        grown = b.result["host_peak_run"] - a.result["host_peak_run"]
        if grown <= 0 or b.params <= a.params:
            return None
        return grown / GB / ((b.params - a.params) / 1e9)


def spec_for(
    label: str, shape: ModelShape, layers: int, checkpoint: Path, timeout_s: float, save: bool = True
) -> JobSpec:
    system, knobs, _ = SYSTEMS[label]
    return JobSpec(
        system=system,
        model=shape.with_layers(layers),
        ranks=RANKS,
        global_batch=RANKS,
        seq=SEQ,
        steps=STEPS,
        warmup=1,
        precision=PRECISION,
        checkpointing=True,
        knobs=dict(knobs),
        timeout_s=timeout_s,
        checkpoint_dir=str(checkpoint),
        save=save,
        export=system == "slidedp",
    )


def reload_check(export: Path, timeout_s: float) -> str:
    """transformers reloads the export with no missing or unexpected keys and finite weights ("" when it does)."""
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "m, info = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, output_loading_info=True)\n"
        "bad = {k: v for k, v in info.items() if v and k != 'error_msgs' or (k == 'error_msgs' and v)}\n"
        "finite = all(torch.isfinite(p).all() for p in m.parameters())\n"
        "print('ok' if not bad and finite else f'reload: {bad} finite={finite}')\n"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, str(export)], capture_output=True, text=True, timeout=timeout_s, cwd=REPO
        )
    except subprocess.TimeoutExpired:
        return f"reload: still running after {timeout_s:.0f} s"
    last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    return "" if proc.returncode == 0 and last == "ok" else f"reload failed: {last[-300:]}"


def attempt(
    label: str, shape: ModelShape, layers: int, ckpts: ShardedCheckpoints, out: Path, limit: int, save: bool = True
) -> Attempt:
    t0 = time.perf_counter()
    spec = spec_for(label, shape, layers, ckpts.directory(layers), timeout_s=1800.0, save=save)
    folder = out / label / f"L{layers}"
    (res,) = run_job([(label, spec)], folder, mem_limit=limit, preflight=False)
    summary = res.summary()
    status = _status(res)
    if status == "fits" and spec.export:
        why = reload_check(folder / label / "export", timeout_s=600.0)
        status = why or status
    _clean(folder / label)
    return Attempt(layers, spec.model.num_params, status, summary, time.perf_counter() - t0)


def _status(res: RunResult) -> str:
    if res.status == "oom":
        return "does not fit"
    if res.status != "ok":
        return f"{res.status}: {res.reason[:300]}"
    if not res.losses or not all(math.isfinite(x) for x in res.losses):
        return f"non-finite losses {res.losses}"
    return "fits"


def _clean(folder: Path) -> None:
    """The attempt's checkpoint and export (GBs each) go once measured; its results stay."""
    import shutil

    for name in ("checkpoint", "export"):
        shutil.rmtree(folder / name, ignore_errors=True)


def first_guess(label: str, shape: ModelShape, limit: int) -> int:
    if shape is TINY:
        return 2
    slope, besides = SYSTEMS[label][2]
    embed = shape.with_layers(0).num_params / 1e9
    per_layer = shape.with_layers(1).num_params / 1e9 - embed
    return max(1, int((limit / GB - besides - slope * embed) / (slope * per_layer)))


def not_run(label: str) -> str:
    """Why ``label`` is not searched on this host ("" when it is): with the FP32 master on disk the devices read the
    BF16 copy, the only weights in host memory, so that system computes in bf16 only (the job refuses 32-true, the
    precision every system trains in on a host without fast bf16)."""
    if not SYSTEMS[label][1].get("master_on_disk") or PRECISION == "bf16-mixed":
        return ""
    return f"not run: needs bf16-mixed, and this host computes in {PRECISION} (no fast bf16)"


def _needs_slope_size(found: Search, lo: int) -> bool:
    """Whether the search has only sizes too close for a slope: none fits at half the deepest fitting depth."""
    return lo > 1 and not any(a.fits and a.layers <= lo // 2 for a in found.attempts)


def _time_for_another(found: Search, lo: int, spent_s: float, budget_s: float) -> bool:
    """Whether one more attempt, and the slope's second size where one is still needed, end within the budget: each
    takes about as long as this system's attempts so far."""
    per = sum(a.seconds for a in found.attempts) / len(found.attempts)
    return spent_s + per * (1 + _needs_slope_size(found, lo)) <= budget_s


def search(
    label: str,
    shape: ModelShape,
    ckpts: ShardedCheckpoints,
    out: Path,
    limit: int,
    budget_s: float,
    save: bool = True,
    attempt_at: Callable[[int], Attempt] | None = None,
) -> Search:
    """The deepest fitting model: gallop from the first guess, then bisect, within ``budget_s``: once a depth fits,
    an attempt starts only if it and the slope's second size are expected to end in time; before that the search
    goes on down past the budget (by doubling steps: a few attempts), since a system's row needs a depth that fits.
    ``attempt_at(layers)`` runs one attempt (default: :func:`attempt`)."""
    found = Search(label)
    run_at = attempt_at or (lambda layers: attempt(label, shape, layers, ckpts, out, limit, save))
    t0 = time.perf_counter()
    lo, hi = 0, None  # deepest known to fit, shallowest known not to (or to fail otherwise)
    layers = first_guess(label, shape, limit)
    step = max(1, round(layers * 0.05))  # the guess is close: small steps first, doubling
    while True:
        a = run_at(layers)
        found.attempts.append(a)
        log.info("capacity %s: %d layers (%.2f B params): %s", label, layers, a.params / 1e9, a.status)
        if a.fits:
            lo = layers
        else:
            hi = layers
        if hi is None:  # every attempt fit: gallop up
            layers, step = layers + step, step * 2
        elif lo == 0:  # none fit yet: gallop down
            if layers == 1:
                break
            layers, step = max(1, layers - step), step * 2
        elif hi - lo <= 1:
            break
        else:
            layers = (lo + hi) // 2
        if lo and not _time_for_another(found, lo, time.perf_counter() - t0, budget_s):
            break
    if _needs_slope_size(found, lo):
        found.attempts.append(run_at(lo // 2))  # a second size for the slope
    return found


def table(searches: list[Search], shape: ModelShape, limit: int, save: bool = True, searched: bool = True) -> str:
    job = f"load + {STEPS} steps{' + save' if save else ' (no checkpoint save)'}"
    rows = [
        f"{'Largest model' if searched else 'Models'} of {shape.name} ({'layers searched' if searched else 'layers as given'}) "
        f"that {'completes' if searched else 'were tried:'} {job} (+ export and "
        f"reload) on {RANKS} CPU ranks in {PRECISION} (every system), under a {limit / GB:.1f} GB host-memory "
        "watchdog (PSS of the whole job).",
        "",
        "| system | layers | params | peak host GB | ledger GB | private GB (all ranks) | load s (GB/s) | step s "
        "| save s | export s | GB per B (slope) | attempts |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in searches:
        a = s.largest
        tried = ", ".join(f"{x.layers}:{'ok' if x.fits else x.status.split(':')[0]}" for x in s.attempts)
        if a is None:
            why = s.why_not_run or (
                "not run: the run's time was used up" if not s.attempts else "fits at no depth tried"
            )
            rows.append(f"| {s.label} | — | {why} | | | | | | | | | {tried} |")
            continue
        r, x = a.result, a.result.get("extra", {})
        load = x.get("load_s")
        slope = s.slope_gb_per_b()
        cells = [
            s.label,
            str(a.layers),
            f"{a.params / 1e9:.2f} B",
            f"{r['host_peak_run'] / GB:.2f}",
            f"{(r.get('ledger_host_bytes') or 0) / GB:.2f}",
            f"{(r.get('private_peak') or 0) / GB:.2f}",
            f"{load:.0f} ({2 * a.params / GB / load:.2f})" if load else "—",
            f"{r.get('step_median_s') or 0:.1f}",
            f"{x['save_s']:.0f}" if "save_s" in x else "—",
            f"{x['export_s']:.0f}" if "export_s" in x else "—",
            f"{slope:.1f}" if slope else "—",
            tried,
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


# the paper's hosts (arXiv 2609.34162, §4): ranks and host memory
PAPER_HOSTS = {"4x RTX 4090, 256 GB": (4, 256), "8x H100, 2 TB": (8, 2048)}
QWEN3_SIZES_B = {"Qwen3-0.6B": 0.6, "Qwen3-1.7B": 1.7, "Qwen3-4B": 4.0, "Qwen3-8B": 8.0, "Qwen3-14B": 14.8}
QWEN3_SIZES_B |= {"Qwen3-32B": 32.8, "Qwen3-30B-A3B": 30.5, "Qwen3-235B-A22B": 235.0}


def extrapolate(searches: list[Search], usable: float = 0.9) -> str:
    """The largest Qwen3 each system would fine-tune on the paper's hosts, from this run: host GB per billion
    parameters (the slope between its two deepest fitting models) and the rest of its peak at the deepest one
    (everything but slope x params: interpreters and per-rank buffers of R = 2 ranks, taken per rank), with
    ``usable`` of the host's memory. An upper bound for what a GPU host keeps per rank on the host."""
    rows = [
        f"Extrapolated from the table ({100 * usable:.0f} % of host memory usable): host GB = slope x B params + "
        "per-rank rest x ranks.",
        "",
        "| system | GB per B | per-rank rest GB | " + " | ".join(PAPER_HOSTS) + " |",
        "|---|---|---|" + "---|" * len(PAPER_HOSTS),
    ]
    for s in searches:
        a, slope = s.largest, s.slope_gb_per_b()
        if a is None:
            continue
        if slope is None:
            rows.append(f"| {s.label} | — | — | " + " | ".join(["no slope: its fitting sizes' peaks did not grow"]
                                                             * len(PAPER_HOSTS)) + " |")  # fmt: skip
            continue
        rest = max(0.0, (a.result["host_peak_run"] / GB - slope * a.params / 1e9) / RANKS)
        cells = []
        for ranks, host_gb in PAPER_HOSTS.values():
            billions = (usable * host_gb - rest * ranks) / slope
            fits = [name for name, b in QWEN3_SIZES_B.items() if b <= billions]
            cells.append(f"{billions:.0f} B ({max(fits, key=QWEN3_SIZES_B.get) if fits else 'none'})")
        rows.append(f"| {s.label} | {slope:.1f} | {rest:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    parser.add_argument("--limit-gb", type=float, default=22.5, help="the watchdog's host-memory limit")
    parser.add_argument("--minutes", type=float, default=60.0, help="time for the whole search")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--checkpoints", type=Path, default=None, help="where the sharded checkpoints go")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape and a 1.5 GB limit: the procedure, fast")
    parser.add_argument(
        "--layers", type=int, nargs="+", default=None, help="try these depths (each system), instead of a search"
    )
    parser.add_argument(
        "--no-save",
        action="store_true",
        help="leave the checkpoint save out of the job (a disk too small for the state file and a checkpoint)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    shape = TINY if args.tiny else QWEN3_1_7B
    limit = int((1.5 if args.tiny else args.limit_gb) * GB)
    out = args.out or REPO / "results" / time.strftime("capacity-%Y%m%d-%H%M%S", time.gmtime())
    ckpts = ShardedCheckpoints(args.checkpoints or out.parent / f"capacity-checkpoints-{shape.name}", shape, SEQ)
    out.mkdir(parents=True, exist_ok=True)
    searches: list[Search] = []
    t0 = time.perf_counter()
    # each system's share of the time: as the parameters of its first guess (a deeper model's attempt takes longer)
    weight = {
        label: 0 if not_run(label) else shape.with_layers(first_guess(label, shape, limit)).num_params
        for label in args.systems
    }
    for i, label in enumerate(args.systems):
        left = args.minutes * 60 - (time.perf_counter() - t0)
        share = weight[label] / max(1, sum(weight[x] for x in args.systems[i:]))
        why_not = not_run(label)
        if why_not:
            searches.append(Search(label, why_not_run=why_not))
            log.info("capacity %s: %s", label, why_not)
        elif args.layers:
            found = Search(label)
            for layers in args.layers:
                found.attempts.append(attempt(label, shape, layers, ckpts, out, limit, save=not args.no_save))
                log.info("capacity %s: %d layers: %s", label, layers, found.attempts[-1].status)
            searches.append(found)
        else:
            searches.append(search(label, shape, ckpts, out, limit, left * share, not args.no_save))
        text = table(searches, shape, limit, not args.no_save, not args.layers) + "\n\n" + extrapolate(searches)
        (out / "capacity.md").write_text(text + "\n")
        data = [{"label": s.label, "attempts": [a.__dict__ for a in s.attempts], "not_run": s.why_not_run}
                for s in searches]  # fmt: skip
        (out / "capacity.json").write_text(json.dumps(data, indent=1, default=str))
    print(table(searches, shape, limit, not args.no_save, not args.layers) + "\n\n" + extrapolate(searches))
    print(f"\n{time.perf_counter() - t0:.0f} s; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
