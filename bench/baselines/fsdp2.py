"""FSDP2 (``torch.distributed.fsdp.fully_shard`` per decoder layer + root), with or without ``CPUOffloadPolicy``.

``bf16-mixed`` = ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` plus BF16 autocast around the
forward, as SlideDP's ``bf16-mixed`` (BF16 weights, FP32 gradients and master). The optimizer is torch's AdamW
(fused where torch supports it on DTensor parameters, else foreach; the choice is recorded).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from bench.baselines.record import NO_DEVICE_ALLOCATOR, Recorder, cuda_peak
from bench.baselines.workload import JobSpec, adamw_groups, build_model, rank_loader


def run(spec: JobSpec, out: str, rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    device = torch.device("cuda", torch.cuda.current_device()) if spec.accelerator == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(device.type, (spec.ranks,))
    t_load = time.perf_counter()
    model = build_model(spec)
    model.config.use_cache = False
    if spec.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kw: dict = {"mesh": mesh}
    if spec.precision == "bf16-mixed":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if spec.system == "fsdp2_offload":
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=spec.accelerator == "cuda")
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    rec = Recorder(out, rank)
    rec.extra["load_s"] = time.perf_counter() - t_load  # built, loaded and wrapped
    h = spec.hyper
    opt, rec.extra["adamw"] = _adamw(model, h)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if spec.precision == "bf16-mixed"
        else contextlib.nullcontext()
    )
    model.train()
    for batch in rank_loader(spec, rank):
        rec.step_start()
        rec.batch(batch)
        batch = batch.to(device)
        with autocast:
            loss = model(input_ids=batch, labels=batch).loss
        rec.loss(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.barrier()
    rec.steps_done()
    if spec.save:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        t0 = time.perf_counter()
        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=f"{out}/checkpoint")
        rec.extra["save_s"] = time.perf_counter() - t0
    peak = cuda_peak()
    rec.write(peak, "CUDA allocator peak" if peak else NO_DEVICE_ALLOCATOR)


def _adamw(model: torch.nn.Module, h: dict) -> tuple[torch.optim.Optimizer, str]:
    """torch AdamW, fused if one step on these (DTensor) parameters works, else foreach (state reset after)."""
    for kind in ("fused", "foreach"):
        opt = torch.optim.AdamW(
            adamw_groups(model, h), lr=h["lr"], betas=tuple(h["betas"]), eps=h["eps"], **{kind: True}
        )
        try:
            _probe(opt)
            return opt, kind
        except (RuntimeError, NotImplementedError):
            continue
    raise RuntimeError("neither fused nor foreach AdamW runs on these parameters")


def _probe(opt: torch.optim.Optimizer) -> None:
    """Run the optimizer once with zero gradients and lr 0 on copies, so the model is unchanged."""
    params = [p for g in opt.param_groups for p in g["params"]]
    saved = [p.detach().clone() for p in params]
    lrs = [g["lr"] for g in opt.param_groups]
    wds = [g["weight_decay"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        opt.step()
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
                p.grad = None
        for g, lr, wd in zip(opt.param_groups, lrs, wds):
            g["lr"], g["weight_decay"] = lr, wd
        opt.state.clear()
