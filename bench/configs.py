"""Every benchmark configuration, per scale: which runs exist, which processes they share, what they compare.

A :class:`Run` belongs to one ``group``; all runs of a group are compared with each other in a table, so they
must have the same workload (model, initial weights, data, global batch, sequence length, steps, precision,
optimizer hyper-parameters): ``tests/bench/test_configs.py`` checks it for every scale. A :class:`Job` is the
runs that execute in the same R processes, one after the other: the runs whose host memory is reported each get
a job of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.baselines.workload import SYSTEMS, JobSpec, ModelShape
from slidedp_lightning.recipes.settings import default_precision

SCALES = ("cpu", "gpu")


@dataclass(frozen=True)
class Run:
    name: str
    spec: JobSpec
    group: str


@dataclass
class Job:
    name: str
    runs: list[Run] = field(default_factory=list)
    memory: bool = False  # its host memory is reported (then it holds exactly one run)


def _shape(
    name: str,
    hidden: int,
    layers: int,
    inter: int,
    heads: int,
    kv: int,
    vocab: int,
    tied: bool = True,
    head_dim: int = 64,
) -> ModelShape:
    return ModelShape(name, hidden, layers, inter, heads, kv, head_dim, vocab, tied)


@dataclass(frozen=True)
class Scale:
    """Shapes, batches and step counts of one scale."""

    name: str
    accelerator: str
    ranks: int
    slope_shapes: tuple[ModelShape, ...]  # the systems table runs at each; host slope over all of them
    batch: int
    seq: int
    steps: int
    warmup: int
    precision: str
    loss_shape: ModelShape
    loss_batch: int
    loss_seq: int
    loss_steps: int
    chunk_bytes: int
    timeout_s: float
    moe_shape: ModelShape | None = None  # MoE table: every system on a Qwen3-MoE shape
    long_seq: int = 0  # long-sequence table: SlideDP (chunked loss + offload) vs the others at this length
    # every system runs at the first ``systems_sizes`` slope shapes (0: at all of them); SlideDP and the replicated
    # mode at all, for the host-memory slope
    systems_sizes: int = 0

    @property
    def systems_shapes(self) -> tuple[ModelShape, ...]:
        """The shapes at which every system runs (the throughput and memory tables)."""
        return self.slope_shapes[: self.systems_sizes or len(self.slope_shapes)]

    def systems_at(self, shape: ModelShape) -> tuple[str, ...]:
        """The systems that run at one of the slope shapes."""
        return SYSTEMS if shape in self.systems_shapes else SLOPE_SYSTEMS


SLOPE_SYSTEMS = ("slidedp", "replicated")  # the host-memory slope's acceptance compares these two


def _moe(name: str, hidden: int, layers: int, experts: int, top: int, moe_inter: int, vocab: int) -> ModelShape:
    """A Qwen3-MoE shape (4 query heads per KV head, head_dim 64 on the CPU scale, 128 beyond)."""
    head_dim = 64 if hidden <= 512 else 128
    heads = hidden // head_dim
    return ModelShape(
        name,
        hidden,
        layers,
        moe_inter,
        heads,
        max(1, heads // 4),
        head_dim,
        vocab,
        tied=False,
        experts=experts,
        experts_per_tok=top,
        moe_intermediate=moe_inter,
    )


def quick(sc: Scale) -> Scale:
    """``--bench-quick``: every table of the paper comparison in minutes. Every system at the first two model
    sizes, SlideDP and the replicated mode also at the third (the slope needs three); same steps and batches."""
    return replace(sc, name=f"{sc.name}-quick", slope_shapes=sc.slope_shapes[:3], systems_sizes=2)


def scale(name: str, ranks: int | None = None, fast: bool = False) -> Scale:
    """The configurations of scale ``name`` (``fast``: :func:`quick`'s subset)."""
    if fast:
        return quick(scale(name, ranks))
    if name == "cpu":
        slope = tuple(_shape(f"h512-L{n}", 512, n, 1408, 8, 4, 4096) for n in (2, 8, 14, 20, 26))
        return Scale(
            "cpu",
            "cpu",
            ranks or 2,
            slope,
            batch=2,
            seq=32,
            steps=7,
            warmup=2,
            precision=default_precision("cpu"),  # what this host computes fast
            loss_shape=_shape("h128-L2", 128, 2, 384, 4, 2, 512, head_dim=32),
            loss_batch=8,
            loss_seq=32,
            loss_steps=200,
            chunk_bytes=1 << 20,
            timeout_s=240,
            moe_shape=_moe("moe-h256-E8", 256, 2, 8, 2, 256, 4096),
            long_seq=512,
        )
    if name == "gpu":
        v = 151936
        slope = (
            _shape("qwen3-4b", 2560, 36, 9728, 32, 8, v, tied=True, head_dim=128),
            _shape("qwen3-8b", 4096, 36, 12288, 32, 8, v, tied=False, head_dim=128),
            _shape("qwen3-14b", 5120, 40, 17408, 40, 8, v, tied=False, head_dim=128),
        )
        r = ranks or 4
        return Scale(
            "gpu",
            "cuda",
            r,
            slope,
            batch=16 * r,
            seq=1024,
            steps=12,
            warmup=3,
            precision="bf16-mixed",
            loss_shape=_shape("qwen3-0.6b", 1024, 28, 3072, 16, 8, v, tied=True, head_dim=128),
            loss_batch=8 * r,
            loss_seq=512,
            loss_steps=200,
            chunk_bytes=32 << 20,
            timeout_s=3600,
            moe_shape=_moe("qwen3-30b-a3b", 2048, 48, 128, 8, 768, v),
            long_seq=32768,
        )
    raise ValueError(f"unknown scale {name!r}; one of {SCALES}")


ROUTES = {
    "full+gpu_reduce": {"param_route": "full", "grad_route": "gpu_reduce"},
    "full+host_reduce": {"param_route": "full", "grad_route": "host_reduce"},
    "sharded+gpu_reduce": {"param_route": "sharded", "grad_route": "gpu_reduce"},
    "sharded+host_reduce": {"param_route": "sharded", "grad_route": "host_reduce"},
    "auto": {"param_route": "auto", "grad_route": "auto"},
}
DEFAULT_ROUTE = "full+gpu_reduce"  # SlideDPStrategy's defaults
TRACE_RUN = "trace/slidedp"


def plan(sc: Scale, init_root: Path, init=None) -> list[Job]:
    """The jobs of one scale. ``init(shape, seq, root)`` makes (or finds) a shape's initial weights file."""
    from bench.baselines.workload import init_file_for

    init = init or init_file_for

    def spec(system: str, shape: ModelShape, **kw) -> JobSpec:
        base = dict(
            system=system,
            model=shape,
            ranks=sc.ranks,
            global_batch=sc.batch,
            seq=sc.seq,
            steps=sc.steps,
            warmup=sc.warmup,
            precision=sc.precision,
            accelerator=sc.accelerator,
            timeout_s=sc.timeout_s,
        )
        base.update(kw)
        base["init_file"] = str(init(shape, base["seq"], init_root))
        return JobSpec(**base)

    jobs: list[Job] = []
    for shape in sc.slope_shapes:
        for system in sc.systems_at(shape):
            name = f"systems/{shape.name}/{system}"
            jobs.append(Job(name, [Run(name, spec(system, shape), f"systems/{shape.name}")], memory=True))
    small = sc.slope_shapes[0]
    g = 2 * sc.batch  # variant tables: twice the per-rank batch of the systems table
    variants = Job("variants")  # "variants/slidedp" (defaults) is also routes full+gpu_reduce and chunking off
    for system in ("slidedp", "replicated"):
        variants.runs.append(Run(f"variants/{system}", spec(system, small, global_batch=g), "variants"))
    for route, knobs in ROUTES.items():
        if route != DEFAULT_ROUTE:
            variants.runs.append(
                Run(f"routes/{route}", spec("slidedp", small, global_batch=g, knobs=knobs), "variants")
            )
    for label, chunk in (("on", sc.chunk_bytes), ("auto", "auto")):
        knobs = {"chunk_bytes": chunk}
        variants.runs.append(Run(f"chunking/{label}", spec("slidedp", small, global_batch=g, knobs=knobs), "variants"))
    # the lanes of one SlideDP run, for the Gantt plot; last, so that tracing slows no measured run
    trace = spec("slidedp", small, global_batch=g, knobs={"lane_trace": True})
    variants.runs.append(Run(TRACE_RUN, trace, "variants"))
    autopolicy = Job("autopolicy")
    for label, policy in (("off", "full"), ("on", "auto")):
        knobs = {"activation_policy": policy}
        autopolicy.runs.append(
            Run(f"autopolicy/{label}", spec("slidedp", small, global_batch=g, knobs=knobs), "variants")
        )
    jobs += [variants, autopolicy]
    one = Job("scaling-R1")  # R = 1 at the same global batch (strong) and at the same per-rank batch (weak)
    for system in ("slidedp", "replicated"):
        for kind, batch in (("strong", g), ("weak", g // sc.ranks)):
            one.runs.append(
                Run(
                    f"scaling/R1-{kind}/{system}",
                    spec(system, small, ranks=1, global_batch=batch),
                    f"scaling/R1-{kind}",
                )
            )
    jobs.append(one)
    if sc.moe_shape is not None:
        for system in SYSTEMS:
            name = f"moe/{system}"
            jobs.append(Job(name, [Run(name, spec(system, sc.moe_shape), "moe")]))
    if sc.long_seq:  # per-rank batch 1 at the long length; SlideDP adds the chunked loss and half offload
        for system in ("slidedp", "ddp", "fsdp2"):
            knobs = {"loss_chunk": 256, "activation_policy": "full@0.5"} if system == "slidedp" else {}
            name = f"long/{system}"
            s = spec(system, small, global_batch=sc.ranks, seq=sc.long_seq, knobs=knobs)
            jobs.append(Job(name, [Run(name, s, "long")], memory=True))
    for system in ("slidedp", "fsdp2"):
        job = Job(f"loss/{system}")
        for precision in ("32-true", "bf16-mixed"):
            s = spec(
                system,
                sc.loss_shape,
                global_batch=sc.loss_batch,
                seq=sc.loss_seq,
                steps=sc.loss_steps,
                warmup=2,
                precision=precision,
                checkpointing=False,
                timeout_s=sc.timeout_s * 2,
            )
            job.runs.append(Run(f"loss/{precision}/{system}", s, f"loss/{precision}"))
        jobs.append(job)
    return jobs


def runs_by_group(jobs: list[Job]) -> dict[str, list[Run]]:
    out: dict[str, list[Run]] = {}
    for job in jobs:
        for run in job.runs:
            out.setdefault(run.group, []).append(run)
    return out
