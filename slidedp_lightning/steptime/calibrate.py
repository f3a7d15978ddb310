"""Measure this machine's profile: R CPU ranks (gloo) measure compute, copies, collectives and the update at once.

Copies and collectives reuse the runtime's route probe (``probe_routes``) at two sizes (latency + bandwidth);
compute runs the model's forward/backward at two batch sizes through a one-rank SlideDP engine and reads its
traced compute lane (per-op overhead + FLOP rate, the runtime's hooks included), in the precision the profile is
for (``32-true``, or ``bf16-mixed``: BF16 units under BF16 autocast, as the strategy runs it); the update runs the Numba AdamW
kernel with the runtime's thread budget. Every rank measures while the others do the same.

With ``hosts`` N > 1, a second probe measures the "network" between N simulated hosts of R ranks on this machine
(gloo over loopback, the process groups the strategy builds for several nodes): the all-reduce between the same
local rank of every host, at several sizes (latency + bandwidth), one pair of ranks at a time so that each rank has
a core to itself as in the single-host probes; and the cores the N x R co-located ranks share (a matmul loop on one
host's ranks, then on all). The same all-reduce with every pair at once and the flat reduce-scatter / all-gather
over all N x R ranks are measured as well and kept in the raw results, for checking the model against them.
"""

from __future__ import annotations

import contextlib
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
from slidedp_lightning.constants import update_bytes_per_param
from slidedp_lightning.runtime.compat import all_gather_into, reduce_scatter_into
from slidedp_lightning.runtime.route_probe import probe_routes
from slidedp_lightning.steptime.graph import PRECISIONS
from slidedp_lightning.steptime.profiles import COMPUTE_PRECISION_KEY, GB, LOOP_KEY, LOSS_KEY, Profile
from slidedp_lightning.steptime.workload import load_config, units

log = logging.getLogger(__name__)
REPEATS = 9
SIZES = (1 << 16, 1 << 18, 1 << 20, 1 << 22)  # elements probed (latency-dominated ... bandwidth-dominated)
SMALL, LARGE = SIZES[0], SIZES[-1]
# glibc's largest dynamic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): a block of this size or more (with
# its header) is mapped anew for every allocation and unmapped when freed, so its first write faults in every page
ALLOC_REUSE_BYTES = 32 * 2**20
FRESH_ELEMS = 1 << 24  # 64 MiB of FP32: above it
ROUTE_PASSES = 3  # route probes per size (each the median of its own repeats); their median is kept


def _timed(fn, group, repeats: int = REPEATS, stat=statistics.median) -> float:
    """``stat`` (the median unless told) of ``repeats`` timed runs of ``fn`` after one untimed, its largest over the
    ranks of ``group``."""
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    t = torch.tensor([stat(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _fit_points(xs: list[float], ts: list[float]) -> tuple[float, float]:
    """(latency s, rate per s) of t = latency + x / rate through several points: least squares on the relative error
    (weights 1/t^2, so the small sizes set the latency and the large ones the rate), latency >= 0."""
    w = [1.0 / max(t, 1e-12) ** 2 for t in ts]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs)) / sw
    mt = sum(wi * t for wi, t in zip(w, ts)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs))
    slope = sum(wi * (x - mx) * (t - mt) for wi, x, t in zip(w, xs, ts)) / sxx if sxx > 0 else 0.0
    if slope <= 0:
        raise RuntimeError(f"calibration: time did not grow with size ({list(zip(xs, ts))})")
    lat = mt - slope * mx
    if lat < 0:  # through the origin instead
        slope, lat = sum(wi * x * t for wi, x, t in zip(w, xs, ts)) / sum(wi * x * x for wi, x in zip(w, xs)), 0.0
    return lat, 1.0 / slope


def _fit(x1: float, t1: float, x2: float, t2: float) -> tuple[float, float]:
    """(latency s, rate per s) of t = latency + x / rate through two points."""
    slope = (t2 - t1) / (x2 - x1)
    if slope <= 0:
        raise RuntimeError(f"calibration: time did not grow with size ({t1:.3g}s at {x1:.3g}, {t2:.3g}s at {x2:.3g})")
    return max(0.0, t1 - slope * x1), 1.0 / slope


RUNTIME_STEPS, RUNTIME_WARMUP = 9, 2  # traced steps per batch size of the runtime compute probe, warm-up among them


def _model_config(model_name: str) -> dict:
    """The transformers config of a shipped model name, a config JSON or a checkpoint directory."""
    from importlib import resources

    from slidedp_lightning.steptime.workload import SHIPPED

    if model_name.lower() in SHIPPED:
        package, rel = SHIPPED[model_name.lower()]
        return json.loads(resources.files(package).joinpath(rel).read_text())
    path = Path(model_name)
    return json.loads((path / "config.json" if path.is_dir() else path).read_text())


def _new_model(model_name: str):
    """A random-init model of ``model_name``'s shapes (weights do not change the timings)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = _model_config(model_name)
    cfg.pop("attn_implementation", None)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen3Config.from_dict(cfg), attn_implementation="sdpa")


def _autocast(precision: str):
    """The context forward runs in under ``precision`` (the strategy's precision plugin: BF16 autocast for
    ``bf16-mixed``)."""
    if precision == "bf16-mixed":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _runtime_compute(
    model_name: str, seq: int, batches: tuple[int, ...], threads: int, group, precision: str = "32-true"
) -> dict[int, tuple]:
    """Per batch size: median forward and backward compute-lane seconds per step as the runtime runs them (its
    hooks included) in ``precision``, read from the lane trace of a one-rank SlideDP engine in this process."""
    from slidedp_lightning.runtime.engine import EngineConfig, SlideDPEngine

    model = _new_model(model_name)
    vocab = model.get_input_embeddings().num_embeddings
    out: dict[int, tuple] = {}
    with tempfile.TemporaryDirectory() as trace:
        engine = SlideDPEngine(
            model,
            EngineConfig(trace_dir=trace, update_threads=threads),
            device=torch.device("cpu"),
            compute_dtype=torch.bfloat16 if precision == "bf16-mixed" else torch.float32,
        )
        try:
            engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-5))
            for b in batches:
                ids = torch.randint(4, min(vocab, 64), (b, seq))
                first = engine.step
                for _ in range(RUNTIME_STEPS):  # the recipe's batch: ids, mask and labels, the loss in the model
                    dist.barrier(group=group)
                    with _autocast(precision):
                        loss = model(
                            input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, use_cache=False
                        ).loss
                    loss.backward()
                    engine.end_step()
                spans = [sp for sp in engine.tracer.spans if sp.lane == "compute"]
                per_step = [
                    tuple(
                        sum(sp.end - sp.start for sp in spans if sp.step == k and sp.name == name)
                        for name in ("forward", "backward")
                    )
                    for k in range(first + RUNTIME_WARMUP, engine.step)
                ]
                out[b] = tuple(statistics.median(t[i] for t in per_step) for i in (0, 1))
        finally:
            engine.close(restore=False)
    return out


def _compute(
    model_name: str, seq: int, batches: tuple[int, int], group, threads: int, precision: str = "32-true"
) -> dict[str, float]:
    """Compute constants in ``precision``: forward and backward from the runtime's traced compute lane (per-op
    overhead + FLOP rate through two batch sizes), the loss from the plain model."""
    shape = load_config(model_name)
    model = _new_model(model_name)
    us = units(shape, seq, "none")
    fwd_per_token = sum(u.fwd_flops_per_token for u in us)
    losses = []
    for b in batches:
        ids = torch.randint(4, min(shape.vocab, 64), (b, seq))
        holder = {}

        def fwd() -> None:
            holder["logits"] = model(input_ids=ids, use_cache=False).logits

        def loss() -> None:
            holder["loss"] = torch.nn.functional.cross_entropy(holder["logits"].float().flatten(0, 1), ids.flatten())

        with torch.no_grad(), _autocast(precision):
            t_f = _timed(fwd, group)

            def fwd_and_loss() -> None:
                fwd()
                loss()

            losses.append(_timed(fwd_and_loss, group) - t_f)
    runtime = _runtime_compute(model_name, seq, batches, threads, group, precision)
    (f1, b1), (f2, b2) = runtime[batches[0]], runtime[batches[1]]
    x1, x2 = (b * seq * fwd_per_token for b in batches)
    lat, rate = _fit(x1, f1, x2, f2)
    # every rank uses the slowest rank's numbers
    t1, t2 = (b * seq for b in batches)
    per_token = max(0.0, (losses[1] - losses[0]) / (t2 - t1))  # the loss: fixed part + per token
    vec = torch.tensor(
        [lat, 1 / rate, (b2 - b1) / (f2 - f1), max(0.0, losses[0] - per_token * t1), per_token], dtype=torch.float64
    )
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    lat, inv_rate, ratio, step_overhead, per_token = vec.tolist()
    return {
        "gpu_flops": 1 / inv_rate,
        "op_overhead_s": lat / len(us),
        "bwd_fwd_ratio": ratio,
        "step_overhead_s": step_overhead,
        "loss_s_per_token": per_token,
    }


def _worker(rank: int, world: int, init: str, out_path: str, model: str, seq: int, precision: str) -> None:
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
        for n in SIZES:
            passes = [
                probe_routes(
                    src,
                    n,
                    rank=rank,
                    world_size=world,
                    device=torch.device("cpu"),
                    dtype=torch.float32,
                    group=group,
                    param_group=param_group,
                    want_param=True,
                    want_grad=True,
                    want_chunks=False,
                ).seconds
                for _ in range(ROUTE_PASSES)
            ]
            probes[n] = {k: statistics.median(p[k] for p in passes) for k in passes[0]}
        copy_lat, copy_rate = _fit_points([n * 4 for n in SIZES], [probes[n]["param_full"] for n in SIZES])
        copy = lambda nbytes: copy_lat + nbytes / copy_rate  # noqa: E731
        frac = (world - 1) / world
        ag = [probes[n]["param_sharded"] - copy(n * 4 / world) for n in SIZES]
        rs = [probes[n]["grad_gpu_reduce"] - copy(n * 4 / world) for n in SIZES]
        ag_lat, ag_rate = _fit_points([n * 4 * frac for n in SIZES], ag)
        rs_lat, rs_rate = _fit_points([n * 4 * frac for n in SIZES], rs)
        # the update: this rank's kernel on LARGE parameters, all ranks at once
        p, m, v, g = (torch.zeros(LARGE).numpy() for _ in range(4))
        t_upd = _timed(
            lambda: cpu_ops.adamw_update(
                p, m, v, g, step=1, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01
            ),
            group,
        )
        upd_rate = LARGE * update_bytes_per_param(4) / t_upd
        # a copy into a buffer allocated for it, too large for the allocator to keep (fresh pages each time)
        big = torch.randn(FRESH_ELEMS)
        t_fresh = _timed(lambda: torch.empty(FRESH_ELEMS).copy_(big), group)
        res["fresh_rate"] = FRESH_ELEMS * 4 / t_fresh
        big = torch.empty(0)  # the source goes back before the next measurement
        res.update(
            copy_lat=copy_lat,
            copy_rate=copy_rate,
            link_lat=(ag_lat + rs_lat) / 2 / max(1, world - 1),
            link_rate=min(ag_rate, rs_rate),
            upd_rate=upd_rate,
        )
        res.update(_compute(model, seq, (8, 32), group, threads, precision))
        if rank == 0:
            Path(out_path).write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


NET_SIZES = (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 21)  # elements of the inter-host message per rank (FP32)
NET_REPEATS = 9
CORE_MATMULS = 64  # 256 x 256 matmuls per rank and timed run of the core-sharing probe


def _network_worker(
    rank: int, hosts: int, ranks: int, init: str, out_path: str, sizes: tuple[int, ...], repeats: int
) -> None:
    world = hosts * ranks
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    # the strategy's groups for several nodes: per local rank, that rank of every host; then all ranks
    for h in range(hosts):
        dist.new_group(list(range(h * ranks, (h + 1) * ranks)))
    cross = [dist.new_group([h * ranks + r for h in range(hosts)]) for r in range(ranks)]
    everyone = dist.new_group(list(range(world)))
    flat = dist.new_group(list(range(world)))
    local = rank % ranks
    threads = cpu_ops.thread_budget(ranks)
    torch.set_num_threads(threads)
    try:
        res: dict[str, float] = {}
        for n in sizes:
            buf = torch.zeros(n)

            def alone() -> None:
                if local == 0:
                    dist.all_reduce(buf, group=cross[0])

            res[f"pair_alone_{n}"] = _timed(alone, everyone, repeats)
            # the fit's input: the fastest run, since the other ranks' scheduling on shared cores only ever adds time
            # (a median at 16 KB has come out above the one at 4 MB on a loaded 2-core machine)
            res[f"pair_alone_best_{n}"] = _timed(alone, everyone, repeats, stat=min)
            res[f"pairs_all_{n}"] = _timed(lambda: dist.all_reduce(buf, group=cross[local]), everyone, repeats)
        for n in sizes[1:4]:  # the whole message over the N R ranks, each rank's piece n / (N R)
            piece, whole = torch.zeros(n // world), torch.zeros(n // world * world)
            res[f"flat_reduce_scatter_{n}"] = _timed(
                lambda: reduce_scatter_into(piece, whole, group=flat), everyone, repeats
            )
            res[f"flat_all_gather_{n}"] = _timed(lambda: all_gather_into(whole, piece, group=flat), everyone, repeats)
        # core sharing: a CPU-bound kernel on one host's R ranks, then on all N R ranks at once; each run is timed
        # until the last rank has finished (the machine's throughput, not a lucky rank's)
        a = torch.randn(256, 256)

        def kernel(busy: bool) -> None:
            if busy:
                for _ in range(CORE_MATMULS):
                    torch.mm(a, a)
            dist.barrier(group=everyone)

        one, every = [], []
        kernel(True)
        for _ in range(repeats):  # alternated, so that a change of the machine's load hits both alike
            one.append(_timed(lambda: kernel(rank < ranks), everyone, 1))
            every.append(_timed(lambda: kernel(True), everyone, 1))
        res["core_one_host"], res["core_all_hosts"] = statistics.median(one), statistics.median(every)
        if rank == 0:
            Path(out_path).write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def measure_network(
    hosts: int = 2, ranks: int = 2, sizes: tuple[int, ...] = NET_SIZES, repeats: int = NET_REPEATS
) -> dict[str, float]:
    """Spawn ``hosts`` x ``ranks`` gloo ranks and return the inter-host probe's raw times (seconds) and its fits:
    ``net_lat`` (s per ring step) and ``net_rate`` (bytes/s per rank) of the all-reduce between hosts at ``sizes``
    (FP32 elements, at least two; fitted to each size's fastest run), and ``colocated_cores``."""
    if hosts < 2:
        raise ValueError(f"the network probe needs hosts >= 2, got {hosts}")
    if len(set(sizes)) < 2 or min(sizes) < hosts * ranks:
        raise ValueError(f"the network probe needs at least two sizes of >= {hosts * ranks} elements, got {sizes}")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "net.json")
        init = f"tcp://127.0.0.1:{_free_port()}"
        mp.start_processes(
            _network_worker,
            args=(hosts, ranks, init, out, tuple(sizes), repeats),
            nprocs=hosts * ranks,
            start_method="spawn",
        )
        raw = json.loads(Path(out).read_text())
    moved = 2 * (hosts - 1) / hosts * 4  # bytes over the network per rank per element of the message
    lat, rate = _fit_points([n * moved for n in sizes], [raw[f"pair_alone_best_{n}"] for n in sizes])
    raw.update(net_lat=lat / (2 * (hosts - 1)), net_rate=rate, hosts=hosts, ranks=ranks)
    raw["colocated_cores"] = shared_cores(
        cpu_ops.physical_cores(), hosts, cpu_ops.logical_cpus(), raw["core_one_host"], raw["core_all_hosts"]
    )
    log.info(
        "network probe (%d hosts x %d ranks): %.3g GB/s per rank, %.3g ms per step",
        hosts,
        ranks,
        rate / 1e9,
        lat / (2 * (hosts - 1)) * 1e3,
    )
    return raw


def shared_cores(cores: int, hosts: int, cpus: int, t_one_host: float, t_all_hosts: float) -> float:
    """Cores the N x R co-located ranks get together, in the units of the R-rank probes (R ranks = the machine's
    ``cores``): N x the kernel's time on one host's R ranks over its time on all N R ranks. Bounded by N x cores
    and by the ``cpus`` the ranks may run on: all ranks together cannot get more CPUs than the machine lets them
    have, so a larger ratio is the probe's noise (a slow one-host run), not capacity."""
    return min(cores * hosts, cpus, cores * hosts * t_one_host / t_all_hosts)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int = 2, model: str = "qwen3-tiny", seq: int = 26, precision: str = "32-true") -> dict[str, float]:
    """Spawn ``world`` gloo ranks and return the raw measurements (seconds, bytes/s, FLOP/s), the compute in
    ``precision``."""
    if precision not in PRECISIONS:
        raise ValueError(f"calibrate measures compute in one of {PRECISIONS}, got {precision!r}")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "calib.json")
        init = f"tcp://127.0.0.1:{_free_port()}"
        mp.start_processes(_worker, args=(world, init, out, model, seq, precision), nprocs=world, start_method="spawn")
        return {**json.loads(Path(out).read_text()), COMPUTE_PRECISION_KEY: precision}


def measure_disk(directory: str, nbytes: int = 1 << 30) -> tuple[float, str]:
    """The state file's disk in ``directory``: GB/s of reads and writes at once with the update lane's direct
    I/O, and where that number comes from."""
    from slidedp_lightning.runtime.ledger.disk import measure_ceiling

    ceiling = measure_ceiling(directory, nbytes)
    io = "direct" if ceiling.direct else "buffered"
    return ceiling.mixed_gbps, (
        f"probe: calibrate --state-dir {directory}: {nbytes >> 20} MiB in {ceiling.chunk_bytes >> 20} MiB pieces, "
        f"{ceiling.depth} in flight, {io} I/O, half written and half read at once (write alone "
        f"{ceiling.write_gbps:.2f}, read alone {ceiling.read_gbps:.2f} GB/s)"
    )


def build_profile(
    raw: dict[str, float],
    world: int,
    model: str,
    seq: int,
    net: dict | None = None,
    disk: tuple[float, str] | None = None,
) -> Profile:
    """The measurements as a profile of this machine (R CPU ranks sharing the cores); with ``net`` (from
    :func:`measure_network`) also its loopback "network" between co-located hosts, with ``disk`` (from
    :func:`measure_disk`) the disk of a state file."""
    src = f"probe: calibrate with {world} gloo ranks on {cpu_ops.physical_cores()} cores ({model}, seq {seq})"
    cores = cpu_ops.physical_cores()
    rate_gb = raw["copy_rate"] / 1e9
    values = {
        "gpus": cores,
        "gpu_flops": raw["gpu_flops"],
        "gpu_efficiency": 1.0,
        "bwd_fwd_ratio": raw["bwd_fwd_ratio"],
        "op_overhead_s": raw["op_overhead_s"],
        "step_overhead_s": raw["step_overhead_s"],
        "h2d_gbps": {str(world): rate_gb},
        "d2h_gbps": {str(world): rate_gb},
        "copy_latency_s": raw["copy_lat"],
        "link_kind": "loopback",
        "link_gbps": raw["link_rate"] / 1e9,
        "link_latency_s": raw["link_lat"],
        "host_dram_gbps": 2 * world * rate_gb,
        "cpu_cores": cores,
        "update_gbps": {str(cores): raw["upd_rate"] * world / 1e9},
        "host_is_device": True,
    }
    if "fresh_rate" in raw:
        values.update(fresh_gbps=raw["fresh_rate"] / 1e9, alloc_reuse_bytes=ALLOC_REUSE_BYTES)
    if LOSS_KEY in raw:
        values[LOSS_KEY] = raw[LOSS_KEY]
    values[COMPUTE_PRECISION_KEY] = raw.get(COMPUTE_PRECISION_KEY, "32-true")
    sources = {k: src for k in values}
    sources[COMPUTE_PRECISION_KEY] = src + f"; forward, backward and loss timed in {values[COMPUTE_PRECISION_KEY]}"
    if "fresh_rate" in raw:
        sources["fresh_gbps"] = (
            src + f"; copy into a new {FRESH_ELEMS * 4 >> 20} MiB buffer per copy, all ranks at once"
        )
        sources["alloc_reuse_bytes"] = (
            "assumed: glibc's largest dynamic mmap threshold on 64-bit "
            "(DEFAULT_MMAP_THRESHOLD_MAX): blocks of this size or more are mapped anew on every allocation"
        )
    sources["gpu_efficiency"] = "probe: gpu_flops is the achieved rate"
    sources["host_dram_gbps"] = src + "; 2 x concurrent memcpy rate (read + write)"
    desc = f"this machine, {world} CPU ranks as devices"
    if net is not None:
        n, r = net["hosts"], net["ranks"]
        where = f"probe: calibrate --hosts {n}, {n} x {r} gloo ranks on {cores} cores over loopback"
        values.update(
            net_gbps=net["net_rate"] * r / 1e9, net_latency_s=net["net_lat"], colocated_cores=net["colocated_cores"]
        )
        sources.update(
            net_gbps=f"{where}; 2-rank all-reduce between hosts, one pair at a time, least-squares fit to the "
            f"fastest of the repeats over {min(NET_SIZES)}..{max(NET_SIZES)} FP32 elements: per-rank rate x "
            f"{r} ranks per host",
            net_latency_s=f"{where}; latency of the same fit per ring step",
            colocated_cores=f"{where}: the hosts are process groups on this one machine; a 1-thread matmul loop on "
            f"one host's {r} ranks, then on all {n * r}: {cores} cores x {n} x (time on {r}) / (time "
            f"on {n * r}), the cores all ranks share in the units of the {r}-rank probes, at most "
            f"the CPUs they may run on",
        )
        desc += f"; {n} co-located hosts (loopback network)"
    if disk is not None:
        values["disk_gbps"], sources["disk_gbps"] = disk
    return Profile("this-machine", values, sources, desc)


def with_loop(profile: Profile, trace_dir: str | Path, tokens: int, hosts: int = 1) -> Profile:
    """``profile`` with ``loop_overhead_s`` measured from the lane traces of a real training run (``trace_dir``, all
    of its ranks, ``hosts`` hosts of them, ``tokens`` per rank and step): the compute thread's median time per step
    outside the runtime's traced work (:func:`~slidedp_lightning.steptime.traces.loop_time`), less what the model
    already counts there (the loss of ``tokens`` as ``calibrate`` measured it and the loss all-reduce's latency)."""
    from slidedp_lightning.steptime.graph import loss_sync_latency
    from slidedp_lightning.steptime.traces import loop_time, traced_ranks

    if tokens < 1:
        raise ValueError(f"tokens must be >= 1 (batch x sequence length per rank of the traced run), got {tokens}")
    trace_dir = Path(trace_dir)
    ranks = len(traced_ranks(trace_dir))
    if hosts < 1 or ranks % hosts:
        raise ValueError(f"{trace_dir} holds traces of {ranks} ranks, not a multiple of hosts={hosts}")
    if ranks // hosts > profile.gpus:
        raise ValueError(f"{trace_dir}: {ranks // hosts} ranks per host, the profile models at most {profile.gpus}")
    measured = loop_time(trace_dir)
    sync = loss_sync_latency(ranks // hosts, hosts, profile)
    loss = profile.loss_seconds(tokens)
    loop = max(0.0, measured - loss - sync)
    values, sources = dict(profile.values), dict(profile.sources)
    values[LOOP_KEY] = loop
    sources[LOOP_KEY] = (
        f"probe: lane traces of a training run ({trace_dir}, {ranks} ranks): the compute thread's "
        f"median {measured * 1e3:.1f} ms per step outside the runtime's traced work, less the loss "
        f"of {tokens} tokens ({loss * 1e3:.1f} ms) and its all-reduce ({sync * 1e3:.2f} ms)"
    )
    log.info("training loop: %.1f ms per step outside the traced work (%s)", loop * 1e3, trace_dir)
    return Profile(profile.name, values, sources, profile.description)


def with_disk(profile: Profile, trace_dir: str | Path, skip: int = 2) -> Profile:
    """``profile`` with ``disk_gbps`` measured from the lane traces of a real training run with its state on disk
    (``trace_dir``, every rank of one host; the steps after ``skip``): the bytes its ranks read and wrote a step over
    the time any of them had a read or write under way (:func:`~slidedp_lightning.steptime.traces.disk_rate`). The
    disk as the job used it, in place of the probe's minute, which on a disk whose rate moves is another disk."""
    from slidedp_lightning.steptime.traces import disk_rate

    rate, seen = disk_rate(trace_dir, skip)
    values, sources = dict(profile.values), dict(profile.sources)
    before = values.get("disk_gbps")
    values["disk_gbps"] = rate / GB
    sources["disk_gbps"] = (
        f"probe: lane traces of a training run ({trace_dir}, {seen['steps']} steps): the median step read and wrote "
        f"{seen['bytes'] / GB:.2f} GB in {seen['busy_s']:.2f} s of disk time"
        + ("" if before is None else f" (the profile's probe had {before:.2f} GB/s)")
    )
    log.info("state file's disk: %.2f GB/s as the traced run used it (%s)", rate / GB, trace_dir)
    return Profile(profile.name, values, sources, profile.description)
