"""The invariant on a CUDA device: one rank of SlideDP (streams, pinned ledger, device timing events, CPU update
lane) equals single-device Lightning + torch.optim.AdamW in FP32, for every route, chunk size, window and
activation policy; bf16-mixed tracks that reference. Skipped without a GPU (the same knobs run on CPU in
test_equivalence.py)."""

from __future__ import annotations

import pytest
import torch

from tests.integration.conftest import BATCH, STEPS, assert_ok, compare_runs, shm_files, variant_result

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# one process runs every variant in turn (one start-up, one Numba compilation)
VARIANTS = {
    "gpu_reduce": {"grad_route": "gpu_reduce"},
    "host_reduce-window1": {"grad_route": "host_reduce", "prefetch_window": 1},
    "chunk4KiB-window3": {"chunk_bytes": 4096, "prefetch_window": 3},
    "full-offload0.5": {"activation_policy": "full@0.5"},
    "selective-host_reduce": {"activation_policy": "selective@0", "grad_route": "host_reduce"},
    "auto": {"param_route": "auto", "grad_route": "auto", "chunk_bytes": "auto", "activation_policy": "auto"},
}
COMMON = dict(accelerator="cuda", devices=1, tied=True, steps=STEPS, batch=BATCH, distributed_sampler=False)


@pytest.fixture(scope="module")
def cuda_jobs(job_runner, tmp_path_factory):
    variants = {**VARIANTS, "traced": {"trace_dir": str(tmp_path_factory.mktemp("cuda_trace"))}}
    ref = job_runner("cuda_ref_single_fp32", strategy="single", **COMMON)
    got = job_runner(
        "cuda_slidedp_variants", strategy="slidedp", variants=variants, keep_going=True, timeout=600, **COMMON
    )
    return ref, got


@pytest.mark.parametrize("variant", sorted(VARIANTS) + ["traced"])
def test_one_cuda_rank_equals_single_device_adamw(cuda_jobs, variant: str) -> None:
    ref, got = cuda_jobs
    assert_ok(ref)
    result = variant_result(got, variant)
    assert_ok(result)
    compare_runs(ref, result, ranks=1)
    assert not shm_files(), "a shared-memory ledger file was left behind"


def test_cuda_bf16_mixed_tracks_the_fp32_reference(job_runner) -> None:
    steps = 50
    common = {**COMMON, "steps": steps}
    ref = job_runner("cuda_ref_single_fp32_50", strategy="single", **common)
    got = job_runner("cuda_slidedp_bf16_50", strategy="slidedp", precision="bf16-mixed", **common)
    assert_ok(ref)
    assert_ok(got)
    a, b = ref.losses(0), got.losses(0)
    assert len(a) == len(b) == steps
    worst = max(abs(x - y) for x, y in zip(a, b))
    assert worst <= 2e-2, f"bf16 loss differs from FP32 by {worst:.4f}"
    first, last = sum(b[:5]) / 5, sum(b[-5:]) / 5
    assert last < 0.8 * first, f"loss did not fall ({first:.3f} -> {last:.3f})"


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
VARIANTS_2 = {
    "gpu_reduce-chunk4KiB": {"chunk_bytes": 4096},  # a chunk's collective input is a temporary
    "sharded-chunk4KiB": {"param_route": "sharded", "chunk_bytes": 4096},
    "replicated": {"param_route": "replicated"},  # host-tensor collectives beside NCCL
    "host_reduce": {"grad_route": "host_reduce"},
}


@TWO_GPUS
@pytest.mark.parametrize("variant", sorted(VARIANTS_2))
def test_two_cuda_ranks_equal_ddp_adamw(job_runner, variant: str) -> None:
    common = {**COMMON, "devices": 2, "distributed_sampler": True}
    ref = job_runner("cuda_ref_ddp2_fp32", strategy="ddp", **common)
    got = job_runner("cuda_slidedp2_variants", strategy="slidedp", variants=VARIANTS_2, timeout=600, **common)
    assert_ok(ref)
    assert_ok(got)
    compare_runs(ref, variant_result(got, variant), ranks=2)


@TWO_GPUS
def test_two_cuda_ranks_with_clipping_equal_ddp_adamw(job_runner) -> None:
    """Clipping needs the global norm before any update (deferred updates: a host-tensor all-reduce)."""
    common = {**COMMON, "devices": 2, "distributed_sampler": True, "clip": 0.05}
    ref = job_runner("cuda_ref_ddp2_clip", strategy="ddp", **common)
    got = job_runner("cuda_slidedp2_clip", strategy="slidedp", **common)
    assert_ok(ref)
    assert_ok(got)
    compare_runs(ref, got, ranks=2)
