"""Where a rank sits in the job: every ``torch.distributed`` group the runtime uses and all rank arithmetic.

Built once, by :meth:`Topology.build` on every rank (process groups are created collectively, in the same order
everywhere), and handed to the engine; nothing else creates groups or computes which rank owns what.

Vocabulary: a job has ``hosts`` hosts of ``ranks_per_host`` ranks each. The ranks that split each unit of the
model into shards (the *shard ranks*) are the host's ranks when every host keeps a full ledger
(``host_layout="replicated"``), or all ranks of the job when each host's ledger holds 1/N of the state
(``host_layout="sharded"``). With ``param_route="replicated"`` (the benchmark baseline) every rank keeps a ledger
of its own and owns every unit whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed import ProcessGroup

from slidedp_lightning.constants import HostLayout

if TYPE_CHECKING:
    from slidedp_lightning.runtime.config import EngineConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topology:
    """One rank's view of the job (single process by default)."""

    global_rank: int = 0
    local_rank: int = 0
    ranks_per_host: int = 1
    hosts: int = 1
    host: int = 0  # this rank's host (node rank)
    host_layout: HostLayout = "replicated"
    ledger_per_rank: bool = False  # param_route="replicated": a private ledger on every rank
    world: ProcessGroup | None = None  # every rank of the job
    host_group: ProcessGroup | None = None  # this host's ranks
    cross: ProcessGroup | None = None  # several hosts, full ledgers: this local rank's peers on the other hosts
    leaders: ProcessGroup | None = None  # local rank 0 of every host (on those ranks only)
    param_group: ProcessGroup | None = None  # the shard ranks again, for the H2D lane's all-gathers
    # every group :meth:`build` created that this rank is a member of (other hosts' groups included): what
    # :meth:`destroy_groups` destroys
    created: tuple[ProcessGroup, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.local_rank < self.ranks_per_host:
            raise ValueError(f"local rank {self.local_rank} is outside this host's {self.ranks_per_host} ranks.")
        if not 0 <= self.host < self.hosts:
            raise ValueError(f"host {self.host} is outside the job's {self.hosts} hosts.")
        if self.global_rank != self.host * self.ranks_per_host + self.local_rank:
            raise ValueError(
                f"global rank {self.global_rank} is not host {self.host} x {self.ranks_per_host} ranks + local rank "
                f"{self.local_rank}: SlideDP needs the same number of ranks on every host, numbered host by host."
            )

    # -- construction -------------------------------------------------------------------------------
    @classmethod
    def for_routes(
        cls,
        routes: EngineConfig,
        *,
        global_rank: int,
        local_rank: int,
        ranks_per_host: int,
        hosts: int = 1,
        host_layout: HostLayout = "replicated",
    ) -> Topology:
        """The groups a job with these routes needs (collective, see :meth:`build`): a ledger per rank for
        ``param_route="replicated"`` on more than one rank, the all-gather group for the sharded route (and for
        its measurement under ``"auto"``)."""
        return cls.build(
            global_rank=global_rank,
            local_rank=local_rank,
            ranks_per_host=ranks_per_host,
            hosts=hosts,
            host_layout=host_layout,
            ledger_per_rank=routes.param_route == "replicated" and hosts * ranks_per_host > 1,
            param_group=routes.param_route in ("sharded", "auto"),
        )

    @classmethod
    def build(
        cls,
        *,
        global_rank: int,
        local_rank: int,
        ranks_per_host: int,
        hosts: int = 1,
        host_layout: HostLayout = "replicated",
        ledger_per_rank: bool = False,
        param_group: bool = False,
    ) -> Topology:
        """Create every group the runtime needs (a collective call: every rank of the job, same arguments).

        ``param_group``: also a second group of the shard ranks for the all-gathers of the sharded parameter
        route (or its measurement), so that each group sees its collectives in one order on every rank.
        """
        host = global_rank // ranks_per_host if ranks_per_host else 0
        world_size = hosts * ranks_per_host
        if world_size == 1:
            return cls(global_rank, local_rank, ranks_per_host, hosts, host, host_layout, ledger_per_rank)
        if not dist.is_initialized():
            raise RuntimeError(f"a SlideDP job of {world_size} ranks needs an initialized torch.distributed group.")
        created: list[ProcessGroup] = []

        def new_group(ranks: list[int]) -> ProcessGroup | None:
            group = dist.new_group(ranks)
            if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
                created.append(group)  # a rank outside ``ranks`` gets a placeholder that holds nothing
            return group

        world = dist.group.WORLD
        host_group, cross, leaders = world, None, None
        if hosts > 1:
            per_host = [new_group(list(range(h * ranks_per_host, (h + 1) * ranks_per_host))) for h in range(hosts)]
            crosses = [new_group([h * ranks_per_host + r for h in range(hosts)]) for r in range(ranks_per_host)]
            leaders_group = new_group([h * ranks_per_host for h in range(hosts)])
            host_group = per_host[host]
            cross = crosses[local_rank] if host_layout == "replicated" else None
            leaders = leaders_group if local_rank == 0 else None
        out = cls(
            global_rank,
            local_rank,
            ranks_per_host,
            hosts,
            host,
            host_layout,
            ledger_per_rank,
            world,
            host_group,
            cross,
            leaders,
        )
        if param_group and out.shard_world > 1:
            out = replace(out, param_group=out._new_shard_group(new_group))
        return replace(out, created=tuple(created))

    def _new_shard_group(self, new_group: Callable[[list[int]], ProcessGroup | None]) -> ProcessGroup | None:
        """A second group of the shard ranks (every rank creates every host's group, in host order)."""
        if self.host_layout == "sharded" or self.hosts == 1:
            return new_group(list(range(self.world_size)))
        size = self.ranks_per_host
        groups = [new_group(list(range(h * size, (h + 1) * size))) for h in range(self.hosts)]
        return groups[self.host]

    def released(self) -> Topology:
        """The same arithmetic without references to process groups (kept by closed engines)."""
        return replace(self, world=None, host_group=None, cross=None, leaders=None, param_group=None, created=())

    def destroy_groups(self) -> Topology:
        """Destroy every group :meth:`build` created (never the default group, which is not the runtime's); returns
        :meth:`released`. Local, no collective: call it once no rank issues collectives on these groups any more.
        A group's threads end when its last reference goes, so the caller drops its own references too."""
        if dist.is_initialized():  # else the default group's destruction took every group with it
            for group in self.created:
                try:
                    dist.destroy_process_group(group)
                except ValueError:  # destroyed already (by whoever destroyed it first)
                    log.debug("SlideDP: process group %r was destroyed already", group)
        return self.released()

    # -- the whole job --------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host

    @property
    def job_group(self) -> ProcessGroup | None:
        """Every rank of the job (checkpoints, export, agreement), or None when it is a single process."""
        return self.world if self.world_size > 1 else None

    @property
    def host_sharded(self) -> bool:
        """Each host's ledger holds 1/N of the state (several hosts, ``host_layout="sharded"``)."""
        return self.hosts > 1 and self.host_layout == "sharded"

    # -- the ranks that split each unit ---------------------------------------------------------------
    @property
    def shard_world(self) -> int:
        """How many ranks reduce-scatter each unit's gradient (and all-gather its parameters)."""
        return self.world_size if self.host_sharded else self.ranks_per_host

    @property
    def shard_rank(self) -> int:
        """This rank's index among the shard ranks."""
        return self.global_rank if self.host_sharded else self.local_rank

    @property
    def shard_group(self) -> ProcessGroup | None:
        """The group of the shard ranks (None for one rank)."""
        if self.shard_world == 1:
            return None
        return self.world if self.host_sharded else self.host_group

    @property
    def owners(self) -> int:
        """Owners per unit in the ledger's layout: the shard ranks, or 1 when every rank has a ledger."""
        return 1 if self.ledger_per_rank else self.shard_world

    @property
    def owner_rank(self) -> int:
        """This rank's owner index in the layout (0 when every rank has a ledger of its own)."""
        return 0 if self.ledger_per_rank else self.shard_rank

    @property
    def reduce_world(self) -> int:
        """The ranks whose gradients are averaged: every rank of the job, as DDP does."""
        return self.world_size

    # -- the host's ledger ----------------------------------------------------------------------------
    @property
    def ledger_group(self) -> ProcessGroup | None:
        """The ranks that map this rank's ledger (None when it is private)."""
        if self.ledger_per_rank or self.ranks_per_host == 1:
            return None
        return self.host_group

    @property
    def host_owners(self) -> slice:
        """The owner indices whose shards this host's ledger holds."""
        if not self.host_sharded:
            return slice(None)
        return slice(self.host * self.ranks_per_host, (self.host + 1) * self.ranks_per_host)

    @property
    def ledger_copies(self) -> float:
        """Ledgers of full size per host: R with a ledger per rank, 1/N when host-sharded, else 1."""
        if self.ledger_per_rank:
            return float(self.ranks_per_host)
        return 1 / self.hosts if self.host_sharded else 1.0

    @property
    def writes_ledger(self) -> bool:
        """Whether this rank writes its ledger's shared state (weights, stamps) on load and restore."""
        return self.local_rank == 0 or self.ledger_per_rank

    # -- checkpoints ------------------------------------------------------------------------------------
    @property
    def checkpoint_share(self) -> tuple[int, int]:
        """(index, count): this rank writes the index-th of count balanced shares of its host's parameters
        (every host splits alike; with host-sharded ledgers each host writes its elements of those)."""
        return self.local_rank, self.ranks_per_host

    def describe(self) -> str:
        where = f"rank {self.global_rank}/{self.world_size}"
        if self.hosts > 1:
            where += f" (host {self.host}/{self.hosts}, {self.host_layout} ledgers, local rank {self.local_rank})"
        return where
