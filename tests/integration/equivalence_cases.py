"""The FP32 equivalence jobs: the knob cases, their DDP references and the route/chunk/window matrix, shared by the
equivalence, lane-delay and multi-node tests."""

from __future__ import annotations

import json
import re

import torch

from tests.integration.conftest import (
    BATCH,
    STEPS,
    JobResult,
    assert_ok,
    variant_result,
    variants_job,
)


def reference(job_runner, tied: bool, devices: int = 2, **model_knobs):
    strategy = "ddp" if devices > 1 else "single"
    # one process: no DistributedSampler on either side, so both see the loader's own order
    extra = {} if devices > 1 else {"distributed_sampler": False}
    extra.update(model_knobs)
    ref = job_runner(
        f"ref_{strategy}_{_ref_name(tied, **model_knobs)}",
        strategy=strategy,
        devices=devices,
        tied=tied,
        steps=STEPS,
        batch=BATCH,
        **extra,
    )
    assert_ok(ref)
    return ref


CASES = {
    # name: (tied, extra strategy knobs)
    "tied-gpu_reduce": (True, {"grad_route": "gpu_reduce"}),
    "tied-host_reduce": (True, {"grad_route": "host_reduce"}),
    "untied-gpu_reduce": (False, {"grad_route": "gpu_reduce"}),
    "untied-host_reduce": (False, {"grad_route": "host_reduce"}),
    "tied-window1": (True, {"prefetch_window": 1}),
    "untied-window3-host_reduce": (False, {"prefetch_window": 3, "grad_route": "host_reduce"}),
    "tied-sharded-gpu_reduce": (True, {"param_route": "sharded"}),
    "tied-sharded-host_reduce-window3": (
        True,
        {"param_route": "sharded", "grad_route": "host_reduce", "prefetch_window": 3},
    ),
    "untied-sharded-host_reduce-window1": (
        False,
        {"param_route": "sharded", "grad_route": "host_reduce", "prefetch_window": 1},
    ),
    "untied-sharded-gpu_reduce-traced": (False, {"param_route": "sharded", "trace": True}),
    "tied-replicated": (True, {"param_route": "replicated"}),
    "tied-replicated-chunk4KiB": (True, {"param_route": "replicated", "chunk_bytes": 4096}),
    "tied-chunk4KiB": (True, {"chunk_bytes": 4096}),
    "untied-host_reduce-chunk4KiB": (False, {"grad_route": "host_reduce", "chunk_bytes": 4096}),
    "untied-sharded-chunk4KiB-window2": (False, {"param_route": "sharded", "chunk_bytes": 4096}),
    "tied-auto": (True, {"param_route": "auto", "grad_route": "auto", "chunk_bytes": "auto"}),
    "untied-host_reduce-2-update-threads": (False, {"grad_route": "host_reduce", "update_threads": 2}),
    "untied-replicated-window3": (False, {"param_route": "replicated", "prefetch_window": 3}),
    "tied-full-offload0.5-host_reduce": (True, {"activation_policy": "full@0.5", "grad_route": "host_reduce"}),
    "untied-segments-offload1-sharded": (False, {"activation_policy": "segments:0110010@1", "param_route": "sharded"}),
    "tied-selective-offload0.5-window1": (True, {"activation_policy": "selective@0.5", "prefetch_window": 1}),
    "tied-chunked-loss": (True, {"loss_chunk": 7, "grad_route": "host_reduce"}),
    "untied-chunked-loss-full-offload": (
        False,
        {"loss_chunk": 5, "activation_policy": "full@1", "param_route": "sharded"},
    ),
    # no BF16 copy in the ledger: FP32 compute never reads it, so nothing may change
    "untied-no-bf16-copy-sharded": (False, {"bf16_copy": False, "param_route": "sharded"}),
    # frozen parameters: the reference DDP job freezes the same ones (MODEL_KNOBS)
    "tied-freeze-embeddings-host_reduce": (True, {"freeze": ["model.embed_tokens."], "grad_route": "host_reduce"}),
    "untied-freeze-embeddings-sharded": (False, {"freeze": ["model.embed_tokens."], "param_route": "sharded"}),
    "untied-freeze-middle-block": (False, {"freeze": ["model.layers.1."], "layers": 3}),
    # a frozen part of a block beside trainable parameters: laid out last in the unit, no moments kept for it
    "untied-freeze-attention-of-block0-sharded": (
        False,
        {"freeze": ["model.layers.0.self_attn."], "param_route": "sharded"},
    ),
    "untied-freeze-middle-block-sharded-host_reduce": (
        False,
        {"freeze": ["model.layers.1."], "layers": 3, "param_route": "sharded", "grad_route": "host_reduce"},
    ),
    # the moments in a state file on disk, read ahead and written behind by the update lane
    "tied-moments-on-disk-host_reduce": (True, {"state_on_disk": True, "grad_route": "host_reduce"}),
    "untied-moments-on-disk-sharded-chunk4KiB": (
        False,
        {"state_on_disk": True, "param_route": "sharded", "chunk_bytes": 4096, "prefetch_window": 1},
    ),
    # a vocabulary whose embedding is over twice a block: an outlier unit, reduced piece by piece
    "tied-large-vocab": (True, {"vocab": 2048}),
    "tied-large-vocab-chunk4KiB-sharded": (True, {"vocab": 2048, "chunk_bytes": 4096, "param_route": "sharded"}),
}


# knobs of the model itself, not of the strategy: the reference job takes them too
MODEL_KNOBS = ("freeze", "layers", "vocab")


FROZEN = tuple(c for c in CASES if "freeze" in CASES[c][1])
# another model than the P1 path's: compared with DDP only
OTHER_VOCAB = tuple(c for c in CASES if "vocab" in CASES[c][1])


# the one case of the fast tier (pytest -m "not slow"): sharded parameters, host reduction, window 3, tied weights
FAST_CASE = "tied-sharded-host_reduce-window3"


# the other cases are fitted one after the other in one 2-rank job (a variant each, as run_matrix does: the start
# of a job, two interpreters and their imports, is most of a 20-step case's time), and so are their DDP references;
# these run as jobs of their own: the fast tier's case, and tied-auto, whose log a test reads
STANDALONE = (FAST_CASE, "tied-auto")


def _ref_name(tied: bool, **model_knobs) -> str:
    return f"tied{int(tied)}" + re.sub(r"[^\w.-]", "", "".join(f"_{k}{v}" for k, v in sorted(model_knobs.items())))


def _model_knobs(case: str) -> dict:
    return {k: v for k, v in CASES[case][1].items() if k in MODEL_KNOBS}


def _case_knobs(case: str, trace_dir: str) -> dict:
    """The job knobs of ``case``: tied or not, its strategy and model knobs (tracing into ``trace_dir``)."""
    tied, knobs = CASES[case]
    knobs = dict(knobs)
    if knobs.pop("trace", False):  # tracing on must not change a single number
        knobs["trace_dir"] = trace_dir
    return {"tied": tied, **knobs}


def case_result(job_runner, case: str, trace_dir: str) -> JobResult:
    """SlideDP's 2-rank job of ``case``: its own job (STANDALONE), or its variant of the job of all the others."""
    common = dict(strategy="slidedp", devices=2, steps=STEPS, batch=BATCH)
    if case in STANDALONE:
        return job_runner(f"slidedp_{case}", **common, **_case_knobs(case, trace_dir))
    variants = {c: _case_knobs(c, trace_dir) for c in sorted(CASES) if c not in STANDALONE}
    job = variants_job(job_runner, "slidedp_cases", variants, timeout=1800, **common, tied=True)
    return variant_result(job, case)


def case_reference(job_runner, case: str) -> JobResult:
    """DDP + AdamW on 2 ranks for ``case``'s model: its own job for a STANDALONE case, else a variant of the job
    of every distinct reference the other cases need."""
    tied, model = CASES[case][0], _model_knobs(case)
    if case in STANDALONE:
        return reference(job_runner, tied, **model)
    variants = {
        _ref_name(CASES[c][0], **_model_knobs(c)): {"tied": CASES[c][0], **_model_knobs(c)}
        for c in sorted(CASES)
        if c not in STANDALONE
    }
    job = variants_job(
        job_runner, "ref_ddp_cases", variants, strategy="ddp", devices=2, tied=True, steps=STEPS, batch=BATCH
    )
    return variant_result(job, _ref_name(tied, **model))


# every param route x grad route x chunk size x window (replicated all-reduces on the devices: no host_reduce)
MATRIX = {
    f"{p}-{g}-chunk{c or 'unit'}-window{w}": {"param_route": p, "grad_route": g, "chunk_bytes": c, "prefetch_window": w}
    for p in ("full", "sharded", "replicated")
    for g in ("gpu_reduce", "host_reduce")
    if not (p == "replicated" and g == "host_reduce")
    for c in (4096, None)
    for w in (1, 2, 3)
}


MATRIX_STEPS = 6


def run_matrix(job_runner, name: str = "slidedp_matrix", env: dict[str, str] | None = None):
    """One 2-rank job fitting the P1 path ("p1") and then every MATRIX combination, each a fit of its own."""
    variants = {
        "p1": {"param_route": "full", "grad_route": "gpu_reduce", "chunk_bytes": None, "prefetch_window": 2},
        **MATRIX,
    }
    res = job_runner(
        name,
        env=env,
        strategy="slidedp",
        devices=2,
        tied=True,
        steps=MATRIX_STEPS,
        batch=BATCH,
        variants=variants,
        timeout=900,
    )
    assert_ok(res)
    return res


def matrix_result(res, variant: str) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    out = res.out / variant
    losses = [json.loads((out / f"losses_rank{r}.json").read_text()) for r in range(2)]
    assert all(len(x) == MATRIX_STEPS for x in losses), f"{variant}: not every step ran"
    return losses, torch.load(out / "final_state.pt")


def differing(ref: tuple, got: tuple) -> bool:
    return got[0] != ref[0] or any(not torch.equal(ref[1][k], got[1][k]) for k in ref[1])
