"""The paper's replicated baseline in the step-time model: SlideFormer's multi-GPU form, as its public code runs it
(arXiv 2609.34162, §4 compares against it). ``StepConfig(param_route="slideformer")`` selects it in
:func:`slidedp_lightning.steptime.ops.build_ops`.
"""

from __future__ import annotations

import math

from slidedp_lightning.constants import update_bytes_per_param
from slidedp_lightning.steptime.graph import Op, StepConfig, _Builder
from slidedp_lightning.steptime.profiles import Profile
from slidedp_lightning.steptime.workload import units

# --- the paper's replicated baseline: SlideFormer's multi-GPU form ------------------------------------------------
# Read from its public code (RegiaYoung/SlideFormer, multi_gpu/: shared_data_parallel.py, transformer_layer.py,
# offload_transformer.py, scripts/main_dp.py, defaults):
# - one FP32 copy in /dev/shm; every rank converts every full unit FP32 -> BF16 into its pinned staging buffer and
#   uploads it (chunks of 32 M elements, conversion of chunk k+1 overlapping the DMA of chunk k);
# - H2D and D2H run on ONE thread and one CUDA stream (single-buffer default): transfers of a rank are serial;
# - two GPU units (GPU cache of 1 + 1): a fetch reuses the unit of the fetch two places earlier;
# - one pinned gradient buffer: the D2H of unit u waits until the update of unit u+1 has finished;
# - gradients (shared_data_parallel.py ``reduce_chunk``): each rank copies its BF16 chunk into its shared-memory
#   slot, barrier, rank 0 alone allocates a fresh FP32 ``mean`` (``torch.zeros``), adds the R BF16 slots one by one
#   (``mean.add_(slot)``), divides by R and runs FP32 Adam on the chunk, barrier (every rank's update thread waits
#   meanwhile); no rank adds into a shared sum, there is no lock;
# - ``mean.add_(slot)`` with a BF16 operand: torch's CPU TensorIterator promotes the operand into a fresh FP32
#   temporary first (``aten::to`` -> ``_to_copy``, 128 MB for a 32 M-element chunk; profiled with torch 2.13), so each
#   slot costs read 2 + write 4 (the temporary) + read 4 + 4, write 4 (the add) host bytes;
# - threads: every CPU op of a rank (the conversion in its transfer thread; the slot copy, rank 0's sum and the
#   DeepSpeed Adam kernel, whose ``omp parallel for`` team follows torch's intra-op count, in its update thread)
#   runs on ``--cpu-threads`` threads (``torch.set_num_threads``; default 1, "total is ranks times this value");
#   the model takes the README's advice to budget the host's threads across ranks: C / R per rank;
# - after backward every rank drains all transfers and updates (``wait_for_completion``) before the next step.
SF_CHUNK = 32 * 2**20  # elements per chunk (``chunk_numel`` default)
SF_GPU_UNITS = 2
SF_CONVERT_BYTES = 6  # FP32 read 4 + BF16 write 2 per parameter, per rank and fetch
SF_SHM_COPY_BYTES = 4  # BF16 gradient chunk into the shared slot: read 2 + write 2 per parameter, per rank
SF_SLOT_BYTES = 18  # rank 0, per slot summed: BF16 -> FP32 temporary (2 + 4), then mean += temporary (4 + 4 + 4)


def slideformer_reduce_bytes(r: int) -> int:
    """Host bytes rank 0 moves per parameter per step: zero the FP32 mean (4), R x ``mean += slot`` (the BF16 slot
    promoted into an FP32 temporary: read 2, write 4; the add: read 4 + 4, write 4), ``mean /= R`` (8), FP32 AdamW
    with an FP32 gradient (28)."""
    return 4 + SF_SLOT_BYTES * r + 8 + int(update_bytes_per_param(4, rows=1))


def slideformer_ops(cfg: StepConfig, profile: Profile, steps: int) -> list[Op]:
    """One rank of SlideFormer's multi-GPU form (see above); ranks are symmetric, rank 0's update is shared out.

    Rank 0's update of a chunk takes ``work / updater`` (``updater``: one process's update rate on C/R cores); every
    rank's update lane holds it that long (the barriers), and each carries 1/R of its DRAM traffic.
    """
    r = cfg.gpus
    us = units(cfg.model, cfg.seq, cfg.activation, act_bytes=2)
    if any(u.borrows for u in us):
        raise ValueError("param_route 'slideformer': tied embeddings are not modelled")
    n_units, tok, lat = len(us), cfg.tokens, profile.copy_latency_s
    reduce_bytes = slideformer_reduce_bytes(r)
    b = _Builder()
    compute_seq: list[int] = []
    release: list[int | None] = []  # per fetch, in thread order: the op after which its GPU unit is free again
    last_xfer: list[int] = []  # the transfer thread's previous op
    prev_updates: list[int] = []  # every update op of the previous step (wait_for_completion)

    def xfer(op: Op) -> int:
        op.deps += last_xfer[-1:]
        i = b.add(op)
        last_xfer[:] = [i]
        return i

    def fetch(u: int, step: int, tag: str, extra: list[int]) -> int:
        p = us[u].params
        deps = list(extra)
        freed = release[-SF_GPU_UNITS] if len(release) >= SF_GPU_UNITS else None
        if freed is not None:
            deps.append(freed)
        demand: dict[str, float] = {"h2d": 2 * p, "dram": (2 + SF_CONVERT_BYTES) * p, "cpu": SF_CONVERT_BYTES * p}
        i = xfer(Op(f"h2d {tag}", "h2d", step, u, demand, lat, deps))
        release.append(None)
        return i

    def compute(name: str, u: int, step: int, flops: float, deps: list[int]) -> int:
        deps = deps + compute_seq[-1:]
        i = b.add(Op(name, "compute", step, u, {"gpu": flops}, profile.op_overhead_s if flops else 0.0, deps))
        compute_seq.append(i)
        return i

    for step in range(steps):
        fetched: dict[int, tuple[int, int]] = {}  # unit -> (fetch op, index in ``release``)
        fetched[0] = (fetch(0, step, "fwd", prev_updates), len(release) - 1)
        offloaded: dict[int, int] = {}
        for u, unit in enumerate(us):  # forward; pre-forward hook of u fetches u+1
            if u + 1 < n_units:
                fetched[u + 1] = (fetch(u + 1, step, "fwd", []), len(release) - 1)
            f = compute("forward", u, step, tok * unit.fwd_flops_per_token, [fetched[u][0]])
            if u < n_units - 1:  # the head stays resident for its backward
                release[fetched[u][1]] = f
            act = unit.activation
            if act.offload_ratio > 0:
                nbytes = act.retained_bytes_per_token * tok * act.offload_ratio
                offloaded[u] = b.add(Op("offload", "offload", step, u, {"d2h": nbytes, "dram": nbytes}, 0.0, [f]))
        compute("loss", n_units - 1, step, 0.0, [])
        b.ops[compute_seq[-1]].fixed = profile.step_overhead_s
        updates: dict[int, list[int]] = {}
        for u in reversed(range(n_units)):  # backward; pre-backward hook of u fetches u-1
            unit = us[u]
            if u - 1 >= 0:
                fetched[u - 1] = (fetch(u - 1, step, "bwd", []), len(release) - 1)
            ready = [fetched[u][0]]
            if u in offloaded:
                nbytes = b.ops[offloaded[u]].demand["d2h"]
                window = compute_seq[-SF_GPU_UNITS : -SF_GPU_UNITS + 1]
                ready.append(
                    b.add(
                        Op("reload", "offload", step, u, {"h2d": nbytes, "dram": nbytes}, 0.0, window + [offloaded[u]])
                    )
                )
            fwd = tok * unit.fwd_flops_per_token
            if unit.activation.recompute_fraction > 0:
                ready = [compute("recompute", u, step, fwd * unit.activation.recompute_fraction, ready)]
            done = compute("backward", u, step, fwd * profile.bwd_fwd_ratio, ready)
            # post-backward: chunked D2H (after the update of u+1 freed the gradient buffer), then rank 0's update
            n_chunks = max(1, math.ceil(unit.params / SF_CHUNK))
            per = unit.params / n_chunks
            wait = [done] + updates.get(u + 1, [])[-1:]
            upd = []
            for k in range(n_chunks):
                d2h = xfer(Op("d2h", "d2h", step, u, {"d2h": 2 * per, "dram": 2 * per}, lat, wait if k == 0 else [], k))
                demand = {
                    "updater": reduce_bytes * per,
                    "cpu": SF_SHM_COPY_BYTES * per,
                    "dram": (reduce_bytes / r + SF_SHM_COPY_BYTES) * per,
                }
                upd.append(b.add(Op("update", "update", step, u, demand, 0.0, [d2h], k)))
            release[fetched[u][1]] = last_xfer[-1]
            updates[u] = upd
        prev_updates = [i for ops in updates.values() for i in ops]
    return b.ops
