"""Rank arithmetic of every layout: which ranks shard a unit, own a ledger, write a checkpoint share."""

from __future__ import annotations

import pytest

from slidedp_lightning.runtime.topology import Topology


def test_single_process_defaults() -> None:
    t = Topology()
    assert (t.world_size, t.shard_world, t.shard_rank, t.owners, t.owner_rank) == (1, 1, 0, 1, 0)
    assert t.shard_group is None and t.job_group is None and t.ledger_group is None
    assert t.host_owners == slice(None) and t.ledger_copies == 1.0 and t.writes_ledger


def test_one_host_shards_units_over_its_ranks() -> None:
    t = Topology(global_rank=2, local_rank=2, ranks_per_host=4)
    assert (t.world_size, t.shard_world, t.shard_rank, t.owners, t.owner_rank) == (4, 4, 2, 4, 2)
    assert not t.writes_ledger and t.checkpoint_share == (2, 4)


def test_a_ledger_per_rank_owns_every_unit_whole() -> None:
    t = Topology(global_rank=1, local_rank=1, ranks_per_host=2, ledger_per_rank=True)
    assert (t.owners, t.owner_rank, t.shard_world) == (1, 0, 2)
    assert t.writes_ledger and t.ledger_copies == 2.0


def test_replicated_hosts_shard_within_the_host() -> None:
    t = Topology(global_rank=5, local_rank=1, ranks_per_host=4, hosts=2, host=1)
    assert (t.world_size, t.shard_world, t.shard_rank, t.reduce_world) == (8, 4, 1, 8)
    assert t.host_owners == slice(None) and t.ledger_copies == 1.0 and not t.host_sharded


def test_sharded_hosts_shard_over_the_job() -> None:
    t = Topology(global_rank=5, local_rank=1, ranks_per_host=4, hosts=2, host=1, host_layout="sharded")
    assert (t.shard_world, t.shard_rank, t.owners, t.owner_rank) == (8, 5, 8, 5)
    assert t.host_sharded and t.host_owners == slice(4, 8) and t.ledger_copies == 0.5
    assert t.checkpoint_share == (1, 4)  # each host's ranks split its parameters alike


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(global_rank=3, local_rank=1, ranks_per_host=2, hosts=2, host=0), "numbered host by host"),
        (dict(global_rank=0, local_rank=2, ranks_per_host=2), "outside this host"),
        (dict(global_rank=0, local_rank=0, ranks_per_host=2, hosts=2, host=2), "outside the job"),
    ],
)
def test_inconsistent_ranks_are_refused(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Topology(**kw)


def test_released_keeps_the_arithmetic_and_drops_the_groups() -> None:
    t = Topology(global_rank=1, local_rank=1, ranks_per_host=2, world=object(), host_group=object())  # type: ignore[arg-type]
    r = t.released()
    assert r.world is None and r.host_group is None and (r.shard_rank, r.shard_world) == (1, 2)
