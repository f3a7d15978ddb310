"""Plain DDP through Lightning (every rank holds the whole model, gradients and Adam states)."""

from __future__ import annotations

from datetime import timedelta

from bench.baselines import lit
from bench.baselines.record import NO_DEVICE_ALLOCATOR, cuda_peak
from bench.baselines.workload import JobSpec


def run(spec: JobSpec, out: str) -> int:
    """Train ``spec``; returns the global rank."""
    from lightning.pytorch.strategies import DDPStrategy

    backend = "nccl" if spec.accelerator == "cuda" else "gloo"
    strategy = DDPStrategy(process_group_backend=backend, timeout=timedelta(seconds=spec.timeout_s))
    trainer, module = lit.fit(spec, strategy, out, hf_checkpointing=spec.checkpointing, fused_adamw=True)
    peak = cuda_peak()
    module.rec.write(peak, "CUDA allocator peak" if peak else NO_DEVICE_ALLOCATOR)
    return trainer.global_rank
