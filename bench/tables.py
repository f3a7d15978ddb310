"""The paper's tables (arXiv 2609.34162, §4) built from run results; shared by ``bench/test_systems.py`` and
``experiments/``. Every function returns :class:`~bench.report.Table` objects and never invents a value: a
run that did not finish (or has not run yet) appears with its status, and its reason is in the table's notes.
``res`` maps run names to results; a system that the scale does not run at a size has no entry."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

from bench.baselines.hostmem import INTERVAL_S, MAX_SHARE
from bench.baselines.runner import RunResult
from bench.baselines.workload import SYSTEMS
from bench.configs import DEFAULT_ROUTE, ROUTES, Scale
from bench.fit import slope
from bench.report import Table

GB = 1e9
BASELINES = [s for s in SYSTEMS if s != "slidedp"]
SUITE = "systems"


def _why(results: list[RunResult]) -> list[str]:
    """``name: reason`` of each run that has one (a reason starts with its status; else the status is added)."""
    return [
        f"{r.name}: {r.reason if r.reason.startswith(r.status) else f'{r.status}: {r.reason}'}"
        for r in results
        if r.reason
    ]


def _tps(r: RunResult) -> str | float:
    return round(r.tokens_per_s, 1) if r.ok else r.status


def _ms(r: RunResult) -> str | float:
    return round(r.step_median * 1e3, 1) if r.ok else r.status


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def system_runs(res: Mapping[str, RunResult], sc: Scale, shapes=None) -> dict[str, dict[str, RunResult]]:
    """shape name -> system -> result, over ``shapes`` (default: every slope shape) and the systems run there."""
    names = {sh.name: {s: f"systems/{sh.name}/{s}" for s in SYSTEMS} for sh in shapes or sc.slope_shapes}
    return {sh: {s: res[n] for s, n in by.items() if n in res} for sh, by in names.items()}


def throughput(res: Mapping[str, RunResult], sc: Scale) -> list[Table]:
    by = system_runs(res, sc, sc.systems_shapes)
    first = next(iter(by.values()))["slidedp"].spec
    head = (
        f"{sc.ranks} ranks, global batch {first.global_batch}, seq {first.seq}, {first.precision}, full-layer "
        f"activation checkpointing in every system; median of {first.steps - first.warmup - 1} measured steps "
        f"after {first.warmup} warm-up steps"
    )
    rows, ratios = [], {b: [] for b in BASELINES}
    for shape, runs in by.items():
        s = runs["slidedp"]
        for system, r in runs.items():
            ratio = "-"
            if system != "slidedp" and r.ok and s.ok:
                ratio = s.tokens_per_s / r.tokens_per_s
                ratios[system].append(ratio)
            rows.append([shape, f"{r.spec.model.num_params / 1e6:.1f}", system, _tps(r), _ms(r), ratio])
    t1 = Table(
        SUITE,
        "Throughput at matched batch",
        ["model", "M params", "system", "tokens/s", "step ms (median)", "SlideDP / system"],
        rows,
        [head] + _why([r for v in by.values() for r in v.values()]),
    )
    summary = [
        [b, len(v), geomean(v) if v else "-", min(v) if v else "-", max(v) if v else "-"] for b, v in ratios.items()
    ]
    t2 = Table(
        SUITE,
        "SlideDP throughput ratio vs each baseline (geometric mean over model sizes)",
        ["baseline", "sizes", "geomean ratio", "min", "max"],
        summary,
        ["paper (GPU hosts): 1.46x-2.64x vs SlideFormer / MegaTrain / ZeRO-Offload at matched batch"],
    )
    return [t1, t2]


def _device(r: RunResult) -> str:
    if not r.ok:
        return r.status
    d = r.device
    if d is None:
        return f"n/a ({r.device_note})"
    if "max_allocated_bytes" in d:
        return f"{d['max_allocated_bytes'] / GB:.3f} GB allocator peak"
    params, acts, grads = (
        d["peak_resident_param_bytes"],
        d["retained_activation_bytes"],
        d.get("grad_buffer_bytes", 0),
    )
    return (
        f"{(params + acts + grads) / 1e6:.1f} MB (params {params / 1e6:.1f} + activations {acts / 1e6:.1f} + "
        f"gradient buffers {grads / 1e6:.1f})"
    )


def memory(res: Mapping[str, RunResult], sc: Scale) -> list[Table]:
    shape = sc.systems_shapes[-1]
    runs = system_runs(res, sc)[shape.name]
    rows = []
    for system, r in runs.items():
        gb = (lambda v: round(v / GB, 3)) if r.ok else (lambda v, status=r.status: status)
        rows.append(
            [system, gb(r.host_peak), gb(r.host_peak_shmem), gb(r.rss_sum_peak), gb(r.host_peak_run), _device(r)]
        )
    notes = [
        f"model {shape.name} ({shape.num_params / 1e6:.1f} M params), {sc.ranks} ranks, the same global batch for "
        "every system",
        f"host = sum over the job's processes of PSS (/proc/<pid>/smaps_rollup), sampled every {INTERVAL_S:g} s "
        f"(less often where a sample would take over {MAX_SHARE:.0%} of a core); "
        "PSS counts a page shared by k processes 1/k in each, so the shared ledger counts once; 'of which shmem' = "
        "Pss_Shmem; 'RSS sum' counts shared pages once per process; 'whole job' includes start-up, model build and "
        "loading the initial weights",
        "on CPU the device is host memory: device-side bytes are inside the host columns; SlideDP's device column "
        "is its runtime's accounting (peak resident unit parameters + activations retained in the last step)",
    ] + _why(list(runs.values()))
    return [
        Table(
            SUITE,
            "Memory at equal batch",
            [
                "system",
                "host peak GB (training steps)",
                "of which shmem GB",
                "RSS sum GB (same sample)",
                "host peak GB (whole job)",
                "device memory",
            ],
            rows,
            notes,
        )
    ]


def _host_cell(r: RunResult) -> str | float:
    return round(r.host_peak / GB, 3) if r.ok else r.status


class HostSlopes(NamedTuple):
    """The host-memory slope table and the slopes in it (GB per billion parameters, per system)."""

    table: Table
    total: dict[str, float]  # the training-step host peak (PSS sum): every system that ran at every size
    ledger: dict[str, float]  # the ledgers' memory (SlideDP and its replicated mode), measured after the steps


def host_slopes(res: Mapping[str, RunResult], sc: Scale) -> HostSlopes:
    by = system_runs(res, sc)
    shapes = list(by)
    total: dict[str, float] = {}
    ledger: dict[str, float] = {}
    rows = []
    for system in SYSTEMS:
        rs = [by[s][system] for s in shapes if system in by[s]]
        if not rs:
            continue
        cells = [_host_cell(by[s][system]) if system in by[s] else "not run at this size" for s in shapes]
        xs = [r.spec.model.num_params / 1e9 for r in rs]
        if len(rs) >= 2 and all(r.ok for r in rs):
            b, a = slope(xs, [r.host_peak / GB for r in rs])
            total[system] = b
            row = [system, *cells, round(b, 2), round(a, 3)]
        else:
            row = [system, *cells, "-", "-"]
        if all(r.ok and r.ledger_host_bytes is not None for r in rs):
            ledger[system] = slope(xs, [r.ledger_host_bytes / GB for r in rs])[0]
            row.append(round(ledger[system], 3))
        else:
            row.append("-")
        rows.append(row)
    rep, rep_ledger = total.get("replicated"), ledger.get("replicated")
    for row in rows:
        row.append(round(total[row[0]] / rep, 3) if rep and row[0] in total else "-")
        row.append(round(ledger[row[0]] / rep_ledger, 3) if rep_ledger and row[0] in ledger else "-")
    notes = [
        "slope = least-squares line of the training-step host peak (PSS sum over all ranks, GB) against the "
        f"parameter count (billions) over {len(shapes)} model sizes, {sc.ranks} ranks: GB per billion parameters "
        "= bytes per parameter; constant costs (interpreters, libraries) fall into the intercept",
        "ledger slope = the same line through the memory the job's ledgers hold after the training steps (pages "
        "allocated in each ledger file, from the engines' ledger_stats(); a shared ledger counted once); the "
        "rest of the host slope is private memory of the ranks",
        "SlideDP's ledger holds 14 B/param (FP32 master + 2 FP32 moments + BF16 copy) once per host; the "
        "replicated mode one ledger per rank; paper: SlideDP 14.2 GB/B vs 19.8-22.9 GB/B for the baselines",
    ]
    if len(sc.systems_shapes) < len(shapes):
        notes.append(
            f"this scale ({sc.name}) runs every system at the first {len(sc.systems_shapes)} sizes and SlideDP and "
            f"the replicated mode at all {len(shapes)}: the other systems' slopes are lines through "
            f"{len(sc.systems_shapes)} points"
        )
    notes += _why([r for v in by.values() for r in v.values()])
    headers = [
        "system",
        *[f"{s} ({by[s]['slidedp'].spec.model.num_params / 1e6:.1f} M) GB" for s in shapes],
        "slope GB per B params",
        "intercept GB",
        "ledger slope GB per B params",
        "slope / replicated",
        "ledger slope / replicated",
    ]
    return HostSlopes(Table(SUITE, "Host memory slope", headers, rows, notes), total, ledger)


def _pair_rows(pairs: list[tuple[str, RunResult]], base: RunResult) -> list[list[object]]:
    rows = []
    for label, r in pairs:
        ratio = base.step_median / r.step_median if r.ok and base.ok else "-"
        rows.append([label, _ms(r), _tps(r), ratio])
    return rows


def scaling(res: Mapping[str, RunResult], sc: Scale) -> list[Table]:
    rows = []
    for system in ("slidedp", "replicated"):
        two = res[f"variants/{system}"]
        for kind in ("strong", "weak"):
            one = res[f"scaling/R1-{kind}/{system}"]
            speed = two.tokens_per_s / one.tokens_per_s if one.ok and two.ok else "-"
            eff = speed / sc.ranks if speed != "-" else "-"
            rows.append(
                [
                    system,
                    kind,
                    f"{one.spec.global_batch} / {two.spec.global_batch}",
                    f"{one.spec.batch_per_rank} / {two.spec.batch_per_rank}",
                    _ms(one),
                    _ms(two),
                    _tps(one),
                    _tps(two),
                    speed,
                    eff,
                ]
            )
    notes = [
        "strong: the same global batch on 1 and R ranks; weak: the same per-rank batch",
        "speed-up = tokens/s on R ranks / tokens/s on 1 rank; efficiency = speed-up / R",
    ]
    if sc.accelerator == "cpu":
        notes.append(
            f"CPU scale: R = {sc.ranks} ranks share {sc.ranks} cores with the CPU update, the collectives and "
            "the host-memory sampler; 1 rank gets all cores for compute"
        )
    runs = [res[k] for k in res if k.startswith("scaling/") or k in ("variants/slidedp", "variants/replicated")]
    return [
        Table(
            SUITE,
            f"Scaling with rank count (1 -> {sc.ranks})",
            [
                "system",
                "scaling",
                "global batch 1 / R",
                "per-rank batch 1 / R",
                "step ms 1",
                f"step ms {sc.ranks}",
                "tokens/s 1",
                f"tokens/s {sc.ranks}",
                "speed-up",
                "efficiency",
            ],
            rows,
            notes + _why(runs),
        )
    ]


def chunking(res: Mapping[str, RunResult], sc: Scale) -> list[Table]:
    base = res["variants/slidedp"]
    pairs = [
        ("off (one chunk per unit)", base),
        (f"on ({sc.chunk_bytes >> 10} KiB)", res["chunking/on"]),
        ("auto (probed)", res["chunking/auto"]),
    ]
    notes = [
        "gradient-path chunking: each landed chunk of a unit's reduced gradient goes to the CPU update at once",
        "paper: Qwen3-8B, 4 GPUs 3218 -> 3465 tokens/s (+7.7 %); 1 GPU +33.6 %",
    ] + _why([r for _, r in pairs])
    return [
        Table(
            SUITE,
            "Chunking on/off (SlideDP)",
            ["chunking", "step ms", "tokens/s", "speed vs off"],
            _pair_rows(pairs, base),
            notes,
        )
    ]


def autopolicy(res: Mapping[str, RunResult], sc: Scale) -> list[Table]:
    off, on = res["autopolicy/off"], res["autopolicy/on"]
    rows = _pair_rows([("off (full-layer checkpointing)", off), ("on (AutoPolicy plan)", on)], off)
    for row, r in zip(rows, (off, on)):
        row.append(round(r.host_peak / GB, 3) if r.ok and r.host_peak else "n/a (shared job)")
        row.append(_device(r))
    notes = [
        "the first steps (warm-up) include AutoPolicy's probe, calibration and solve; they are not measured",
        "host peak is reported only for runs with a job of their own (these two share processes)",
        "paper (4x H100, Qwen3-14B, batch 32): 17 370 -> 19 530 tokens/s (+12.4 %), host 261.9 -> 200.6 GB",
    ]
    if sc.accelerator == "cpu":
        notes.append(
            "on CPU there is no device memory limit (budget: unlimited) and offload moves activations "
            "from host memory to host memory"
        )
    return [
        Table(
            SUITE,
            "AutoPolicy on/off (SlideDP)",
            ["AutoPolicy", "step ms", "tokens/s", "speed vs off", "host peak GB", "device memory"],
            rows,
            notes + _why([off, on]),
        )
    ]


def routes(res: Mapping[str, RunResult], sc: Scale) -> list[Table]:
    base = res["variants/slidedp"]
    pairs = [(DEFAULT_ROUTE, base)] + [(k, res[f"routes/{k}"]) for k in ROUTES if k != DEFAULT_ROUTE]
    notes = [
        "speed vs the default route (full + gpu_reduce); 'auto' probes the routes at setup",
        "paper (A800): no route wins everywhere; a fixed choice loses 20-30 % on some hardware",
    ]
    if sc.accelerator == "cpu":
        notes.append("on CPU 'host->device' copies are memcpys within host memory and every collective is gloo")
    return [
        Table(
            SUITE,
            "Route comparison (SlideDP)",
            ["route (param + grad)", "step ms", "tokens/s", "speed vs default"],
            _pair_rows(pairs, base),
            notes + _why([r for _, r in pairs]),
        )
    ]


def loss_equivalence(res: Mapping[str, RunResult]) -> tuple[Table, dict[str, float]]:
    rows, diffs = [], {}
    bounds = {"32-true": 1e-4, "bf16-mixed": 1e-2}
    runs = []
    for precision, bound in bounds.items():
        a, b = res[f"loss/{precision}/slidedp"], res[f"loss/{precision}/fsdp2"]
        runs += [a, b]
        if a.ok and b.ok:
            d = [abs(x - y) for x, y in zip(a.losses, b.losses)]
            diffs[precision] = max(d)
            rows.append([precision, len(d), max(d), sum(d) / len(d), a.losses[0], a.losses[-1], b.losses[-1], bound])
        else:
            rows.append([precision, "-", a.status, b.status, "-", "-", "-", bound])
    notes = [
        "per-step loss = mean over ranks of each rank's local loss; the same initial weights file, data and "
        "optimizer hyper-parameters; FSDP2 bf16-mixed = MixedPrecisionPolicy(bf16 params, fp32 reduce) + BF16 "
        "autocast, as SlideDP's bf16-mixed",
        "paper: 200 steps vs FSDP2, max abs difference 0.00063",
    ] + _why(runs)
    return Table(
        SUITE,
        "Loss equivalence: SlideDP vs FSDP2",
        ["precision", "steps", "max abs diff", "mean abs diff", "loss step 0", "SlideDP final", "FSDP2 final", "bound"],
        rows,
        notes,
    ), diffs


def moe(res: Mapping[str, RunResult], sc: Scale) -> list[Table]:
    """Every system on the Qwen3-MoE shape at the systems table's batch."""
    base = res["moe/slidedp"]
    rows = _pair_rows([(s, res[f"moe/{s}"]) for s in SYSTEMS], base)
    for row, s in zip(rows, SYSTEMS):
        r = res[f"moe/{s}"]
        row[3] = round(r.step_median / base.step_median, 3) if r.ok and base.ok else "-"  # SlideDP speed-up
    shape = sc.moe_shape
    notes = [
        f"{shape.name}: {shape.experts} experts of width {shape.moe_intermediate}, top-{shape.experts_per_tok}, "
        f"{shape.num_params / 1e6:.1f} M params; router auxiliary loss on",
        "speed-up = system step time / SlideDP step time; paper (Qwen3.6-35B-A3B, Gemma4-26B-A4B): 1.98x-3.21x vs "
        "ZeRO-Offload",
    ] + _why([res[f"moe/{s}"] for s in SYSTEMS])
    return [Table(SUITE, "MoE throughput", ["system", "step ms", "tokens/s", "SlideDP speed-up"], rows, notes)]


def long_context(res: Mapping[str, RunResult], sc: Scale) -> list[Table]:
    """One long sequence per rank: SlideDP with the chunked loss and half the activations offloaded."""
    runs = [(s, res[f"long/{s}"]) for s in ("slidedp", "ddp", "fsdp2")]
    rows = _pair_rows(runs, runs[0][1])
    for row, (_, r) in zip(rows, runs):
        row.append(round(r.host_peak / GB, 3) if r.ok and r.host_peak else r.status)
        row.append(_device(r))
    notes = [
        f"sequence {sc.long_seq}, batch 1 per rank; SlideDP: loss in 256-token chunks (no full logits), full "
        "checkpointing with half of each retained tensor offloaded; DDP/FSDP2: full-layer checkpointing",
        "the longest trainable sequence at a device budget: experiments/long_context.py; paper: SlideDP trains "
        "Qwen3-14B at 256 K tokens on 4x H100 where FSDP2 and Megatron run out of memory at 64 K",
    ]
    if sc.accelerator == "cpu":
        notes.append(
            "on CPU, offload moves activations from host memory to host memory: the host peak includes "
            "both; the device column is SlideDP's runtime accounting"
        )
    return [
        Table(
            SUITE,
            "Long sequence",
            ["system", "step ms", "tokens/s", "speed vs SlideDP", "host peak GB", "device memory"],
            rows,
            notes + _why([r for _, r in runs]),
        )
    ]
