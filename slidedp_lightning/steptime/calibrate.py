"""Measure this machine's profile: R CPU ranks (gloo) measure compute, copies, collectives and the update at once.

Copies and collectives reuse the runtime's route probe (``probe_routes``) at two sizes (latency + bandwidth);
compute runs the model's forward/backward at two batch sizes (per-op overhead + FLOP rate); the update runs
the Numba AdamW kernel with the runtime's thread budget. Every rank measures while the others do the same.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cpu_ops
from slidedp_lightning.runtime.probe import probe_routes
from slidedp_lightning.steptime.profiles import Profile
from slidedp_lightning.steptime.workload import load_config, units

log = logging.getLogger(__name__)
REPEATS = 5
SMALL, LARGE = 1 << 16, 1 << 22  # elements probed (latency-dominated, bandwidth-dominated)


def _median(fn, group, repeats: int = REPEATS) -> float:
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _fit(x1: float, t1: float, x2: float, t2: float) -> tuple[float, float]:
    """(latency s, rate per s) of t = latency + x / rate through two points."""
    slope = (t2 - t1) / (x2 - x1)
    if slope <= 0:
        raise RuntimeError(f"calibration: time did not grow with size ({t1:.3g}s at {x1:.3g}, {t2:.3g}s at {x2:.3g})")
    return max(0.0, t1 - slope * x1), 1.0 / slope


def _compute(model_name: str, seq: int, batches: tuple[int, int], group) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, Qwen3Config

    from slidedp_lightning.steptime.workload import SHIPPED
    shape = load_config(model_name)
    package, rel = SHIPPED.get(model_name, SHIPPED["qwen3-tiny"])
    from importlib import resources

    cfg = json.loads(resources.files(package).joinpath(rel).read_text())
    cfg.pop("attn_implementation", None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config.from_dict(cfg), attn_implementation="sdpa")
    us = units(shape, seq, "none")
    fwd_per_token = sum(u.fwd_flops_per_token for u in us)
    out = {}
    for b in batches:
        ids = torch.randint(4, min(shape.vocab, 64), (b, seq))
        holder = {}

        def fwd() -> None:
            holder["logits"] = model(input_ids=ids, use_cache=False).logits

        def loss() -> None:
            holder["loss"] = torch.nn.functional.cross_entropy(holder["logits"].float().flatten(0, 1), ids.flatten())

        def bwd() -> None:
            fwd(), loss()
            holder["loss"].backward()
            model.zero_grad(set_to_none=True)

        t_f = _median(fwd, group)
        t_l = _median(lambda: (fwd(), loss()), group) - t_f
        t_b = _median(bwd, group) - t_f - t_l
        out[b] = (b * seq * fwd_per_token, t_f, t_b, t_l)
    (x1, f1, b1, l1), (x2, f2, b2, l2) = out[batches[0]], out[batches[1]]
    lat, rate = _fit(x1, f1, x2, f2)
    n_ops = len(us)
    return {"gpu_flops": rate, "op_overhead_s": lat / n_ops, "bwd_fwd_ratio": (b2 - b1) / (f2 - f1),
            "step_overhead_s": max(0.0, statistics.mean([l1, l2]))}  # fmt: skip


def _worker(rank: int, world: int, init: str, out_path: str, model: str, seq: int) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    param_group = dist.new_group(backend="gloo")
    threads = cpu_ops.thread_budget(world)
    torch.set_num_threads(threads)
    cpu_ops.set_kernel_threads(threads)
    try:
        res: dict[str, float] = {}
        src = torch.randn(LARGE)
        probes = {}
        for n in (SMALL, LARGE):
            probes[n] = probe_routes(src, n, rank=rank, world_size=world, device=torch.device("cpu"), dtype=torch.float32,
                                     group=group, param_group=param_group, want_param=True, want_grad=True,
                                     want_chunks=False).seconds  # fmt: skip
        copy_lat, copy_rate = _fit(SMALL * 4, probes[SMALL]["param_full"], LARGE * 4, probes[LARGE]["param_full"])
        copy = lambda nbytes: copy_lat + nbytes / copy_rate  # noqa: E731
        frac = (world - 1) / world
        ag = {n: probes[n]["param_sharded"] - copy(n * 4 / world) for n in probes}
        rs = {n: probes[n]["grad_gpu_reduce"] - copy(n * 4 / world) for n in probes}
        ag_lat, ag_rate = _fit(SMALL * 4 * frac, ag[SMALL], LARGE * 4 * frac, ag[LARGE])
        rs_lat, rs_rate = _fit(SMALL * 4 * frac, rs[SMALL], LARGE * 4 * frac, rs[LARGE])
        # the update: this rank's kernel on LARGE parameters, all ranks at once
        p, m, v, g = (torch.zeros(LARGE).numpy() for _ in range(4))
        t_upd = _median(lambda: cpu_ops.adamw_update(p, m, v, g, step=1, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                                                          weight_decay=0.01), group)
        upd_rate = LARGE * cpu_ops.update_bytes_per_param(4) / t_upd
        res.update(copy_lat=copy_lat, copy_rate=copy_rate, link_lat=(ag_lat + rs_lat) / 2 / max(1, world - 1),
                   link_rate=min(ag_rate, rs_rate), upd_rate=upd_rate)  # fmt: skip
        res.update(_compute(model, seq, (8, 32), group))
        if rank == 0:
            Path(out_path).write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int = 2, model: str = "qwen3-tiny", seq: int = 26) -> dict[str, float]:
    """Spawn ``world`` gloo ranks and return the raw measurements (seconds, bytes/s, FLOP/s)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "calib.json")
        init = f"tcp://127.0.0.1:{_free_port()}"
        mp.start_processes(_worker, args=(world, init, out, model, seq), nprocs=world, start_method="spawn")
        return json.loads(Path(out).read_text())


def build_profile(raw: dict[str, float], world: int, model: str, seq: int) -> Profile:
    """The measurements as a profile of this machine (R CPU ranks sharing the cores)."""
    src = f"probe: calibrate with {world} gloo ranks on {cpu_ops.physical_cores()} cores ({model}, seq {seq})"
    cores = cpu_ops.physical_cores()
    rate_gb = raw["copy_rate"] / 1e9
    values = {
        "gpus": cores, "gpu_flops": raw["gpu_flops"], "gpu_efficiency": 1.0, "bwd_fwd_ratio": raw["bwd_fwd_ratio"],
        "op_overhead_s": raw["op_overhead_s"], "step_overhead_s": raw["step_overhead_s"],
        "h2d_gbps": {str(world): rate_gb}, "d2h_gbps": {str(world): rate_gb}, "copy_latency_s": raw["copy_lat"],
        "link_kind": "loopback", "link_gbps": raw["link_rate"] / 1e9, "link_latency_s": raw["link_lat"],
        "host_dram_gbps": 2 * world * rate_gb, "cpu_cores": cores,
        "update_gbps": {str(cores): raw["upd_rate"] * world / 1e9}, "host_is_device": True,
    }  # fmt: skip
    sources = {k: src for k in values}
    sources["gpu_efficiency"] = "probe: gpu_flops is the achieved rate"
    sources["host_dram_gbps"] = src + "; 2 x concurrent memcpy rate (read + write)"
    return Profile("this-machine", values, sources, f"this machine, {world} CPU ranks as devices")
