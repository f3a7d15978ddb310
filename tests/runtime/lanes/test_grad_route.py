"""runtime.lanes.grad_route: the flat gradient layout written whole or piece by piece (host_reduce chunks), how long the
gradient buffers live, and the pool that reuses them on a CPU device."""

from __future__ import annotations

import weakref

import pytest
import torch
from transformers import Qwen3ForCausalLM

from slidedp_lightning.runtime.lanes.grad_route import FlatPool, GradRoute, ReducedShard, _fill_flat
from slidedp_lightning.runtime.lanes.streams import CpuLanes
from tests.helpers import tiny_model
from tests.runtime.helpers import layout_of


def test_pieces_of_the_flat_gradient_add_up_to_the_whole_with_zeros_in_gaps_and_padding():
    layout = layout_of(tiny_model(tied=False), world_size=2)
    unit = layout.units[1]
    grads = [torch.randn(s.shape) for s in unit.slots]
    whole = torch.full((unit.padded,), float("nan"))
    _fill_flat(whole, unit, grads)
    assert not whole.isnan().any(), "every element is written, gaps and padding included"
    for a, b in unit.gaps():
        assert not whole[a:b].any()
    for slot, g in zip(unit.slots, grads):
        assert torch.equal(whole[slot.offset : slot.end], g.reshape(-1))
    pieced = torch.full((unit.padded,), float("nan"))
    edges = [0, 7, 1000, 1001, unit.slots[1].offset + 3, unit.padded - 5, unit.padded]  # across slots and gaps
    for a, b in zip(edges, edges[1:]):
        _fill_flat(pieced, unit, grads, a, b)
        assert pieced[b:].isnan().all(), "a piece writes nothing past its end"
    assert torch.equal(pieced, whole)


def test_a_chunk_major_fill_puts_chunk_k_of_every_shard_side_by_side():
    """The chunked reduction's layout: chunk k of every rank's shard next to each other, each exactly the unit
    layout's elements (gaps and padding zero), so each chunk's collective reads a contiguous view."""
    layout = layout_of(tiny_model(tied=False), world_size=2)
    unit, r = layout.units[1], 2
    n = unit.shard_numel
    grads = [torch.randn(s.shape) for s in unit.slots]
    whole = torch.empty(unit.padded)
    _fill_flat(whole, unit, grads)
    chunked = torch.full((unit.padded,), float("nan"))
    chunks = [(a, min(a + 1000, n)) for a in range(0, n, 1000)]
    for a, b in chunks:
        for i in range(r):
            _fill_flat(chunked, unit, grads, i * n + a, i * n + b, at=r * a + i * (b - a))
    assert not chunked.isnan().any()
    for a, b in chunks:
        rows = chunked[r * a : r * b].view(r, b - a)
        for i in range(r):
            assert torch.equal(rows[i], whole[i * n + a : i * n + b]), (a, i)


class _Work:
    """A collective handle that completes when the test says so."""

    def __init__(self) -> None:
        self.completed = False

    def is_completed(self) -> bool:
        return self.completed

    def wait(self) -> None:
        assert self.completed, "wait() on a collective that has not completed would block"


def test_a_reduced_shard_drops_the_collective_buffers_once_landed_and_the_shard_once_released():
    lanes = CpuLanes(torch.device("cpu"))
    try:
        flat, piece, work = torch.zeros(8), torch.ones(4), _Work()
        source = ReducedShard(lanes, piece, None, work, (flat,))
        flat_ref, piece_ref = weakref.ref(flat), weakref.ref(piece)
        del flat, piece
        assert not source.landed(), "the collective is still running"
        assert flat_ref() is not None and source.work is work
        work.completed = True
        assert source.landed()
        assert flat_ref() is None and source.work is None, "the flat gradient goes as soon as the shard landed"
        grad = source.get()
        assert grad.tolist() == [1.0] * 4
        del grad
        assert piece_ref() is not None, "the update has not released the shard yet"
        source.release()
        assert piece_ref() is None
    finally:
        lanes.close()


def test_gradients_are_freed_as_soon_as_they_are_reduced_and_updated(monkeypatch):
    """No compute-dtype gradient survives its dispatch, no reduced shard survives its update (nor waits in the
    update lane for the next task)."""
    from tests.runtime.helpers import adamw_groups, batches, loss_of, make_engine

    dispatched: list[weakref.ref] = []
    reduced: list[weakref.ref] = []
    original = GradRoute._gpu_reduce

    def spy(self, u, grads, step):
        dispatched.extend(weakref.ref(g) for g in grads)
        out = original(self, u, grads, step)
        assert not grads, "the route empties the gradient list once the flat gradient holds it"
        reduced.extend(weakref.ref(source.shard) for _, _, source in out)
        return out

    monkeypatch.setattr(GradRoute, "_gpu_reduce", spy)
    model = tiny_model(tied=True)
    engine = make_engine(model, grad_route="gpu_reduce")
    try:
        engine.attach_optimizer(adamw_groups(model))
        for x in batches(2):
            loss_of(model, x).backward()
            assert engine.end_step()
        engine.synchronize()
        assert dispatched and reduced
        assert all(r() is None for r in dispatched), "a compute-dtype gradient outlived its dispatch"
        assert all(r() is None for r in reduced), "a reduced shard outlived its update"
    finally:
        engine.close()


def test_a_pooled_buffer_returns_when_its_last_holder_drops_it_and_never_while_a_collective_may_write_it():
    pool = FlatPool(16, torch.device("cpu"))
    a = pool.take(2)
    first = a.buf  # held here, so that no new buffer can take its address
    a.drop()
    assert pool.buffers == 1 and pool.take(1).buf.data_ptr() != first.data_ptr(), "one holder still reads it"
    assert pool.buffers == 2
    a.drop()
    b = pool.take(1)
    assert b.buf.data_ptr() == first.data_ptr() and pool.buffers == 2, "the last holder gave it back: reused"
    b.drop(reusable=False)
    assert pool.take(1).buf.data_ptr() != first.data_ptr(), "a buffer a collective may write is not lent again"
    assert pool.buffers == 3 and pool.nbytes == 3 * 16 * 4
    pool.clear()
    assert pool.buffers == 0


def test_a_shard_released_before_its_collective_landed_does_not_return_its_buffer():
    lanes = CpuLanes(torch.device("cpu"))
    try:
        pool = FlatPool(8, torch.device("cpu"))
        lease = pool.take(1)
        buf = lease.buf
        shard = ReducedShard(lanes, buf[:4], None, _Work(), lease=lease)
        shard.release()  # an abandoned step: the collective never completed
        assert pool.take(1).buf.data_ptr() != buf.data_ptr() and pool.buffers == 2
        landed = pool.take(1)
        kept = landed.buf
        shard = ReducedShard(lanes, kept[:4], None, None, lease=landed)
        shard.release()
        assert pool.take(1).buf.data_ptr() == kept.data_ptr(), "a landed shard's buffer is reused"
    finally:
        lanes.close()


@pytest.mark.parametrize(
    "chunk_elems, knobs",
    [(None, {}), (1024, {}), (None, {"accumulate": 2}), (None, {"update": "deferred"})],
    ids=["whole", "chunked", "accumulate", "deferred"],
)
def test_the_flat_gradients_of_a_cpu_device_are_reused_step_after_step(monkeypatch, chunk_elems, knobs):
    """On a CPU device the engine reuses as many flat gradient buffers as units were in flight at once (at most
    ``max_units_in_flight``), chunked or not, whether the update applies, accumulates or defers each gradient; the
    buffers handed out are the same from step to step."""
    from tests.runtime.helpers import adamw_groups, batches, loss_of, make_engine

    used: list[set[int]] = []
    original = FlatPool.take

    def spy(self, users, elems=None):
        lease = original(self, users, elems)
        used[-1].add(lease.buf.data_ptr())
        return lease

    monkeypatch.setattr(FlatPool, "take", spy)
    model = tiny_model(tied=False)
    engine = make_engine(
        model,
        grad_route="gpu_reduce",
        max_units_in_flight=2,
        chunk_bytes=chunk_elems * 4 if chunk_elems else None,
        **knobs,
    )
    micro = knobs.get("accumulate", 1)
    try:
        engine.attach_optimizer(adamw_groups(model))
        for i, x in enumerate(batches(4 * micro)):
            if i % micro == 0:
                used.append(set())
            loss_of(model, x).backward()
            if i % micro == micro - 1:
                assert engine.end_step()
        engine.synchronize()
        pool = engine.routes.pool
        assert 1 <= pool.buffers <= 2, f"{pool.buffers} buffers for at most 2 units in flight"
        assert len(set().union(*used)) == pool.buffers, "every step took its buffers from the same few"
        assert engine.device_memory()["grad_buffer_bytes"] == pool.buffers * engine.layout.max_unit * 4
    finally:
        pool = engine.routes.pool
        engine.close()
    assert pool.buffers == 0


def _gloo_reduce_scatter_vs_all_reduce(rank: int, world: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist

    from slidedp_lightning.runtime.compat import reduce_scatter_into

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(rank)
        n = world * 100_003
        flat = torch.randn(n, generator=g) * 10.0 ** torch.randint(-4, 4, (n,), generator=g)
        piece = torch.empty(n // world)
        reduce_scatter_into(piece, flat.clone())
        dist.all_reduce(flat)
        torch.save((piece, flat.view(world, -1)[rank].clone()), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # spawns a process group
def test_gloo_reduce_scatter_is_an_all_reduce_and_a_slice_bit_for_bit(tmp_path):
    """The gloo path all-reduces the flat gradient in place and copies this rank's slice out: the same sums as
    gloo's reduce-scatter, bit for bit (three ranks, so the summation order matters)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = 3
    mp.spawn(_gloo_reduce_scatter_vs_all_reduce, args=(world, port, str(tmp_path)), nprocs=world)
    for rank in range(world):
        scattered, sliced = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(scattered, sliced), f"rank {rank}"


def _two_hosts_dispatch(rank: int, port: int, out: str) -> None:
    """Ranks 0-1 and 2-3 are two hosts; rank 1 reaches its backward 1.5 s late."""
    import os
    import time

    import torch.distributed as dist

    from slidedp_lightning.runtime.lanes.liveness import Liveness
    from slidedp_lightning.runtime.topology import Topology

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    hosts = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cross = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    lanes = CpuLanes(torch.device("cpu"))
    try:
        layout = layout_of(tiny_model(tied=False), world_size=2)
        topology = Topology(
            global_rank=rank,
            local_rank=rank % 2,
            ranks_per_host=2,
            hosts=2,
            host=rank // 2,
            world=dist.group.WORLD,
            host_group=hosts[rank // 2],
            cross=cross[rank % 2],
        )
        assert (topology.shard_rank, topology.shard_world, topology.reduce_world) == (rank % 2, 2, 4)
        route = GradRoute(
            route="gpu_reduce",
            layout=layout,
            ledger=None,
            lanes=lanes,
            liveness=Liveness(lambda: [], 60.0),
            topology=topology,
        )
        unit = layout.units[1]
        grads = [torch.full(s.shape, float(rank + 1)) for s in unit.slots]
        if rank == 1:
            time.sleep(1.5)
        t0 = time.perf_counter()
        chunks = route.dispatch(1, grads, 0)
        issued = time.perf_counter() - t0
        shard = torch.cat([torch.from_numpy(src.get().copy()) for _, _, src in chunks])
        torch.save((issued, shard, unit.shard(rank % 2)), f"{out}/rank{rank}.pt")
        dist.barrier()
    finally:
        lanes.close()
        dist.destroy_process_group()


@pytest.mark.slow  # spawns a process group
def test_two_hosts_the_compute_thread_does_not_wait_for_the_host_reduction(tmp_path):
    """Replicated ledgers on two hosts, host collectives: the reduction within the host and then between the hosts
    run on the lanes; ``dispatch`` returns while a peer of the host has not even started its reduction, and every
    rank's shard is the mean over all 4 ranks."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_two_hosts_dispatch, args=(port, str(tmp_path)), nprocs=4)
    for rank in range(4):
        issued, shard, (lo, hi) = torch.load(tmp_path / f"rank{rank}.pt")
        if rank != 1:
            assert issued < 0.5, f"rank {rank}: dispatch blocked {issued:.2f} s on the late peer"
        unit = layout_of(tiny_model(tied=False), world_size=2).units[1]
        want = torch.zeros(unit.padded)
        for slot in unit.slots:
            want[slot.offset : slot.end] = (1 + 2 + 3 + 4) / 4
        assert torch.equal(shard, want[lo:hi]), f"rank {rank}"


def test_a_unit_far_larger_than_the_others_does_not_size_every_pooled_buffer() -> None:
    """A large vocabulary's embedding (here 16x a block) gets a buffer of its own size for its reduction, freed
    after it; the pooled buffers stay the size of a block, so the pool never holds an embedding's gradient."""
    from tests.helpers import tiny_config
    from tests.runtime.helpers import adamw_groups, batches, loss_of, make_engine

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_config(tied=True, vocab=8192))
    engine = make_engine(model, grad_route="gpu_reduce", max_units_in_flight=2)
    try:
        engine.attach_optimizer(adamw_groups(model))
        for x in batches(3):
            loss_of(model, x).backward()
            assert engine.end_step()
        engine.synchronize()
        sizes = [u.padded for u in engine.layout.units]
        block, embed = max(sizes[1:-1]), sizes[0]
        assert embed > 8 * block
        pool = engine.routes.pool
        assert pool.elems == block
        assert engine.device_memory()["grad_buffer_bytes"] == pool.nbytes <= 2 * block * 4
        assert 1 <= pool.buffers <= 2
    finally:
        engine.close()


def _outlier_dispatch(rank: int, port: int, out: str) -> None:
    """Two ranks of one host reduce a tied embedding 16x a block's size, recording every FP32 buffer made."""
    import os

    import torch.distributed as dist

    from slidedp_lightning.runtime.lanes.liveness import Liveness
    from slidedp_lightning.runtime.topology import Topology
    from tests.helpers import tiny_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    lanes = CpuLanes(torch.device("cpu"))
    try:
        layout = layout_of(Qwen3ForCausalLM(tiny_config(tied=True, vocab=8192)), world_size=2)
        topology = Topology.build(global_rank=rank, local_rank=rank, ranks_per_host=2)
        route = GradRoute(
            route="gpu_reduce",
            layout=layout,
            ledger=None,
            lanes=lanes,
            liveness=Liveness(lambda: [], 60.0),
            topology=topology,
            chunk_elems=3000,
        )
        u = max(range(len(layout.units)), key=lambda i: layout.units[i].padded)
        unit = layout.units[u]
        g = torch.Generator().manual_seed(rank)
        grads = [torch.randn(s.shape, generator=g) for s in unit.slots]
        made: list[int] = []
        empty = torch.empty

        def recording(*size, **kw):
            t = empty(*size, **kw)
            if t.dtype == torch.float32:
                made.append(t.numel())
            return t

        torch.empty = recording
        try:
            chunks = route.dispatch(u, list(grads), 0)
        finally:
            torch.empty = empty
        shard = torch.cat([torch.from_numpy(src.get().copy()) for _, _, src in chunks])
        flat = torch.zeros(unit.padded)
        _fill_flat(flat, unit, grads)
        torch.save(
            (flat, shard, unit.shard(rank), unit.padded, route.pool_elems, made, len(chunks)), f"{out}/r{rank}.pt"
        )
        dist.barrier()
    finally:
        lanes.close()
        dist.destroy_process_group()


@pytest.mark.slow  # spawns a process group
def test_an_outlier_unit_is_reduced_piece_by_piece_without_a_flat_gradient_of_the_whole_unit(tmp_path):
    """gloo, a tied embedding 16x a block: each rank gets the mean of both ranks' gradients over its shard, in
    chunks, and no FP32 buffer larger than its shard is made (no flat gradient of the whole unit)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_outlier_dispatch, args=(port, str(tmp_path)), nprocs=2)
    flats = [torch.load(tmp_path / f"r{r}.pt")[0] for r in range(2)]
    for rank in range(2):
        _, shard, (lo, hi), padded, pooled, made, chunks = torch.load(tmp_path / f"r{rank}.pt")
        assert padded > 2 * pooled, "the embedding is an outlier unit"
        assert torch.equal(shard, flats[0][lo:hi] / 2 + flats[1][lo:hi] / 2), f"rank {rank}"
        assert chunks == -(-(hi - lo) // 3000)
        assert max(made) <= hi - lo < padded, f"rank {rank}: FP32 buffers of {made} elements for a {padded} unit"
