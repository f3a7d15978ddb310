"""runtime.route_probe: the probe times the reduction the runtime runs."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp


def _probe_on_gloo(rank: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist

    from slidedp_lightning.runtime import route_probe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    calls: list[int] = []
    all_reduce = dist.all_reduce

    def counted(tensor: torch.Tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    def refused(*args, **kwargs):
        raise AssertionError("the probe timed gloo's reduce-scatter, which the runtime does not run on host tensors")

    route_probe.reduce_scatter_into = refused
    route_probe.dist.all_reduce = counted
    try:
        unit = 2 * 8 * 4096
        probe = route_probe.probe_routes(
            torch.zeros(unit),
            unit,
            rank=rank,
            world_size=2,
            device=torch.device("cpu"),
            dtype=torch.float32,
            group=None,
            param_group=None,
            want_param=False,
            want_grad=True,
            want_chunks=True,
        )
        torch.save((probe.seconds, calls), f"{out}/rank{rank}.pt")
    finally:
        route_probe.dist.all_reduce = all_reduce
        dist.destroy_process_group()


@pytest.mark.slow  # spawns a process group
def test_on_gloo_host_tensors_the_probe_times_the_in_place_all_reduce_the_runtime_runs(tmp_path):
    """gloo's reduce-scatter is 1.5-1.8x slower than the in-place all-reduce and slice that GradRoute runs on host
    tensors: a probe (and the step-time calibration built on it) that timed the former priced the reduce lane at
    the wrong rate."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_probe_on_gloo, args=(port, str(tmp_path)), nprocs=2)
    for rank in range(2):
        seconds, calls = torch.load(tmp_path / f"rank{rank}.pt")
        assert {"grad_gpu_reduce", "grad_host_reduce", "chunk_whole", "chunk_1/8"} <= set(seconds)
        assert all(v > 0 for v in seconds.values())
        whole = 2 * 8 * 4096
        # gpu_reduce and the whole unit: 1 warm-up and REPEATS timed, each an all-reduce of the whole unit
        assert calls.count(whole) == 2 * (1 + 3), calls
        assert whole // 8 in calls and whole // 4 in calls and whole // 2 in calls, "each chunk size all-reduced"
