"""Models from other libraries through Lightning: 2 ranks, FP32 on CPU, SlideDP equals DDP + torch.optim.AdamW
for 20 steps (per-step losses on both ranks and the final weights within 1e-4 relative).

The models are tests/integration/library_models.py's, built the way each library's docs build them (LitGPT's
``Config.from_name`` shrunk, torchtune's component builders, torchtitan's Llama 3 model code, a hand-written
nanoGPT, peft LoRA on a transformers Qwen3). A case whose library is not installed is skipped; docs/models.md,
"Models from other libraries", has the install commands. tests/models/test_libraries.py checks how each one splits.
"""

from __future__ import annotations

import pytest
import torch

from tests.integration import library_models
from tests.integration.conftest import BATCH, STEPS, JobResult, assert_ok, variant_result, variants_job

RTOL = 1e-4
FAST = ("litgpt_llama",)  # the one case of the fast tier: its own job, so that it does not wait for the others
SLOW = tuple(name for name in library_models.NAMES if name not in FAST)
CASES = [pytest.param(name, id=name) for name in FAST] + [
    pytest.param(name, id=name, marks=pytest.mark.slow) for name in SLOW
]


def library_jobs(job_runner, strategy: str, names: tuple[str, ...]) -> JobResult:
    """One 2-rank job fitting every installed library model of ``names`` in turn (a variant each: the start of a
    job, two interpreters and their imports, is most of a model's time)."""
    variants = {name: {"library": name} for name in names if library_models.available(name)}
    common = dict(strategy=strategy, devices=2, tied=False, steps=STEPS, batch=BATCH)
    group = "fast" if names == FAST else "slow"
    return variants_job(job_runner, f"libraries_{group}_{strategy}", variants, timeout=1200, **common)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max().clamp_min(1e-12)).item()


def compare(ref: JobResult, got: JobResult, library: library_models.Library) -> None:
    """Per-step losses of both ranks and every final weight within RTOL; of a fused attention bias, the query and
    value parts (its key part is rounding noise: ``Library.key_bias``)."""
    for r in range(2):
        a, b = ref.losses(r), got.losses(r)
        assert len(a) == len(b) == STEPS
        worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
        assert worst <= RTOL, f"rank {r}: per-step loss differs by {worst:.2e} relative"
    sa, sb = ref.state(), got.state()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        key = library.key_bias_slice(k)
        if key is not None:
            keep = torch.ones(sa[k].shape[0], dtype=torch.bool)
            keep[key] = False
            sa[k], sb[k] = sa[k][keep], sb[k][keep]
        assert rel(sa[k], sb[k]) <= RTOL, f"{k}: final weights differ by {rel(sa[k], sb[k]):.2e} relative"


@pytest.mark.integration
@pytest.mark.parametrize("name", CASES)
def test_library_model_matches_ddp(job_runner, name: str) -> None:
    library = library_models.LIBRARIES[name]
    pytest.importorskip(library.module)
    names = FAST if name in FAST else SLOW
    ref = variant_result(library_jobs(job_runner, "ddp", names), name)
    assert_ok(ref)
    got = variant_result(library_jobs(job_runner, "slidedp", names), name)
    assert_ok(got)
    compare(ref, got, library)
