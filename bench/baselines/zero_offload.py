"""ZeRO-Offload: DeepSpeed ZeRO stage 2 with ``offload_optimizer`` to the CPU and DeepSpeed's CPU AdamW.

Gradient clipping is set to 0 explicitly (DeepSpeed 0.19 clips at 1.0 by default, the other systems do not).
On a CPU-only machine ``DS_ACCELERATOR=cpu`` (set by the runner) and "offload" moves no data across PCIe: the
accelerator is the CPU, so the run exercises DeepSpeed's partitioning and CPU optimizer, not a host link.
"""

from __future__ import annotations

import time

import torch

from bench.baselines.record import NO_DEVICE_ALLOCATOR, Recorder, cuda_peak
from bench.baselines.workload import JobSpec, adamw_groups, build_model, rank_loader


def ds_config(spec: JobSpec) -> dict:
    h = spec.hyper
    return {
        "train_batch_size": spec.global_batch,
        "train_micro_batch_size_per_gpu": spec.batch_per_rank,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": spec.accelerator == "cuda"},
        },
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": h["lr"], "betas": list(h["betas"]), "eps": h["eps"], "weight_decay": h["weight_decay"]},
        },
        "bf16": {"enabled": spec.precision == "bf16-mixed"},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def run(spec: JobSpec, out: str, rank: int) -> None:
    import deepspeed

    t_load = time.perf_counter()
    model = build_model(spec)
    model.config.use_cache = False
    if spec.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=adamw_groups(model, spec.hyper), config=ds_config(spec)
    )
    rec = Recorder(out, rank)
    rec.extra["load_s"] = time.perf_counter() - t_load  # built, loaded and wrapped
    rec.extra["optimizer"] = type(engine.optimizer.optimizer).__name__ if hasattr(engine.optimizer, "optimizer") else ""
    engine.train()
    for batch in rank_loader(spec, rank):
        rec.step_start()
        rec.batch(batch)
        batch = batch.to(engine.device)
        loss = engine(input_ids=batch, labels=batch).loss
        rec.loss(loss.item())
        engine.backward(loss)
        engine.step()
    torch.distributed.barrier()
    rec.steps_done()
    if spec.save:
        t0 = time.perf_counter()
        engine.save_checkpoint(f"{out}/checkpoint")
        rec.extra["save_s"] = time.perf_counter() - t0
    peak = cuda_peak()
    rec.write(peak, "CUDA allocator peak" if peak else NO_DEVICE_ALLOCATOR)
