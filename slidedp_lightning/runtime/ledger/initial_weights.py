"""A new ledger's initial weights: read from a checkpoint by every rank (each its share of the units), or the
model's own weights copied (meta-device units materialized one at a time) by local rank 0."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numba
import torch
import torch.distributed as dist
from torch import nn

import cpu_ops
from slidedp_lightning.models.adapter import ArchitectureAdapter
from slidedp_lightning.runtime.host_os import trim_host_heap
from slidedp_lightning.runtime.layout import Layout, Unit
from slidedp_lightning.runtime.ledger.host_ledger import HostLedger
from slidedp_lightning.runtime.ledger.pages import ledger_spans, prepare_pages
from slidedp_lightning.runtime.ledger.weight_source import CheckpointError, weight_source_of
from slidedp_lightning.runtime.progress import ByteProgress, rate
from slidedp_lightning.runtime.topology import Topology

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadReport:
    """How a ledger's initial weights were written."""

    kind: str  # "checkpoint" (read from a WeightSource), "init" (meta units initialized) or "copy" (the model's)
    nbytes: int  # checkpoint: bytes read from storage by this host's ranks; else FP32 bytes written
    seconds: float  # the slowest of the ranks that wrote
    ranks: int  # ranks of this host that wrote

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9)


def balanced_shares(sizes: list[int], count: int) -> list[list[int]]:
    """Indices of ``sizes`` split into ``count`` shares of about equal sum (largest first, each to the lightest
    share so far; the same on every rank)."""
    shares: list[list[int]] = [[] for _ in range(count)]
    load = [0] * count
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(count), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += sizes[i]
    return [sorted(s) for s in shares]


def _buffers(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    return [(m, n, b) for m in module.modules() for n, b in m._buffers.items() if b is not None]


def _restore(buffers: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
    for m, n, b in buffers:
        m._buffers[n] = b


class InitialWeights:
    """Writes the initial weights into a new ledger: read from the model's :class:`WeightSource` (a checkpoint) by
    every rank, each its share of the units; else the model's own weights, copied by local rank 0, which
    materializes meta-device units one at a time."""

    def __init__(self, model: nn.Module, adapter: ArchitectureAdapter, layout: Layout, topology: Topology) -> None:
        self.model, self.adapter, self.layout, self.topology = model, adapter, layout, topology
        self.report: LoadReport | None = None
        source = weight_source_of(model)
        if source is not None and not all(getattr(*s.locations[0]).is_meta for _, s in layout.slots()):
            # parameters given back after an earlier run (its trained weights): they, not the checkpoint, go in
            log.debug("SlideDP: the model's parameters are materialized; %s is not read", source.describe())
            source = None
        self.source = source
        self._names = self._source_names() if source is not None else []

    @property
    def from_source(self) -> bool:
        """Every rank reads its share of the weights from the source (:meth:`load`), instead of local rank 0
        copying them (:meth:`fill`)."""
        return self.source is not None

    def _source_names(self) -> list[list[str]]:
        """Per unit and slot, the name under which the source holds that parameter; raises for any the source
        lacks or holds in another shape (before any ledger exists)."""
        assert self.source is not None
        names_of: dict[int, list[str]] = {}
        for prefix, module in self.model.named_modules(remove_duplicate=False):
            names_of.setdefault(id(module), []).append(prefix)
        provided = self.source.names()
        out, missing, mismatched = [], [], []
        for unit in self.layout.units:
            row = []
            for slot in unit.slots:
                candidates = [
                    f"{prefix}.{attr}" if prefix else attr
                    for module, attr in slot.locations
                    for prefix in names_of.get(id(module), [])
                ]
                name = next((n for n in candidates if n in provided), None)
                if name is None:
                    missing.append(candidates[0] if candidates else slot.name)
                elif tuple(self.source.shape(name)) != tuple(slot.shape):
                    mismatched.append(f"{name}: stored {list(self.source.shape(name))}, model {list(slot.shape)}")
                row.append(name or "")
            out.append(row)
        if missing or mismatched:
            raise CheckpointError(
                f"{self.source.describe()} does not match the streamed model"
                + (f"; missing {len(missing)} parameter(s): {missing[:8]}" if missing else "")
                + (f"; shape mismatch: {mismatched[:8]}" if mismatched else "")
                + (
                    " (parameters added after from_pretrained must get their values where they are created: peft's "
                    "plain LoRA adapters do; variants such as DoRA are computed from weights the meta skeleton does "
                    "not hold, load the model with transformers' from_pretrained for those)"
                    if missing
                    else ""
                )
            )
        return out

    def host_ranges(self) -> list[tuple[int, int]] | None:
        """Host-sharded: the ledger elements ``[a, b)`` of each unit that this host holds; else None (all)."""
        if not self.topology.host_sharded:
            return None
        owners = self.topology.host_owners
        return [
            (u.offset + owners.start * u.shard_numel, u.offset + owners.stop * u.shard_numel) for u in self.layout.units
        ]

    def release_unwritten(self) -> int:
        """A rank that does not write its ledger gives its materialized copy of the weights back at once (local
        rank 0's copy goes into the ledger); returns the bytes freed. Binding only needs the parameters' shapes."""
        if self.source is not None or self.topology.writes_ledger:
            return 0
        freed = 0
        for _, slot in self.layout.slots():
            param = getattr(*slot.locations[0])
            if param.is_meta:
                continue
            freed += param.numel() * param.element_size()
            empty = nn.Parameter(torch.empty(slot.shape, dtype=param.dtype, device="meta"), param.requires_grad)
            for module, attr in slot.locations:
                setattr(module, attr, empty)
        return freed

    # -- local rank 0: the model's own weights ------------------------------------------------------------
    def fill(self, ledger: HostLedger) -> None:
        """Copy the weights in (a new file reads as zeros: moments, gaps and padding need no writing); with
        several hosts every host receives global rank 0's weights."""
        ranges = self.host_ranges()
        leaders = self.topology.leaders
        meta = any(getattr(*s.locations[0]).is_meta for _, s in self.layout.slots())
        kind = "init" if meta else "copy"
        total = 4 * self.layout.num_params
        what = "SlideDP initializing weights" if meta else "SlideDP copying weights"
        with ByteProgress(what, total, show=True) as bar, _paged(ledger):
            if ranges is None:
                for unit in self.layout.units:
                    master = ledger.region("master", unit.index)
                    if master is not None and ledger.extent("master", unit.index) == unit.padded:
                        self._copy_unit(unit, master)
                    else:  # frozen weights that only the BF16 copy keeps, or a master on disk
                        flat = torch.zeros(unit.padded)
                        self._copy_unit(unit, flat)
                        ledger.write_weights(unit.index, 0, flat)
                    bar.update(4 * sum(s.numel for s in unit.slots))
                if leaders is not None:
                    broadcast_weights(ledger, leaders, src=0)
            else:  # each host keeps only its slice of global rank 0's weights, received one unit at a time
                for unit, (a, b) in zip(self.layout.units, ranges):
                    flat = torch.zeros(unit.padded)
                    self._copy_unit(unit, flat)
                    if leaders is not None:
                        dist.broadcast(flat, src=0, group=leaders)
                    a, b = a - unit.offset, b - unit.offset
                    ledger.write_weights(unit.index, a, flat[a:b])
                    bar.update(4 * sum(s.numel for s in unit.slots))
            ledger.refresh_bf16(ranges)
            ledger.clear_moments(ranges)
        self.report = LoadReport(kind, total, bar.seconds, 1)
        if meta:
            log.log(
                logging.INFO if self.topology.global_rank == 0 else logging.DEBUG,
                "SlideDP initialized %s params unit by unit into the ledger: %s of FP32",
                f"{self.layout.num_params:,}",
                rate(total, bar.seconds),
            )

    def _copy_unit(self, unit: Unit, flat: torch.Tensor) -> None:
        """Write ``unit``'s weights into its flat layout ``flat`` (meta modules materialized for the copy only)."""
        materialized = []
        for slot in unit.slots:
            module, attr = slot.locations[0]
            if getattr(module, attr).is_meta:
                self._materialize(module)
                materialized.append(module)
            flat[slot.offset : slot.end].copy_(getattr(module, attr).detach().reshape(-1))
        for module in materialized:  # the unit lives in the ledger now: hand its memory back at once
            buffers = _buffers(module)  # not in the ledger (embedding scales, router biases): they stay
            module.to_empty(device="meta", recurse=True)
            _restore(buffers)
        if materialized:  # to the OS too: glibc keeps freed blocks of a few MB, and they add up unit after unit
            trim_host_heap()

    def _materialize(self, module: nn.Module) -> None:
        buffers = [(m, n, b) for m, n, b in _buffers(module) if not b.is_meta]  # computed ones keep their values
        module.to_empty(device="cpu", recurse=True)
        _restore(buffers)
        with torch.no_grad():
            self.adapter.init_weights(self.model, module)

    # -- every rank: a checkpoint ---------------------------------------------------------------------------
    def _pieces(self, unit: Unit, names: list[str], a: int, b: int) -> list[tuple[str, int, int, int]]:
        """``(name, first element, layout offset, count)`` of each parameter of ``unit`` inside layout ``[a, b)``."""
        out = []
        for slot, name in zip(unit.slots, names):
            s0 = unit.offset + slot.offset
            lo, hi = max(a, s0), min(b, s0 + slot.numel)
            if lo < hi:
                out.append((name, lo - s0, lo, hi - lo))
        return out

    def load(self, ledger: HostLedger) -> None:
        """Collective over the job: every rank reads a balanced share of its ledger's units (host-sharded: of this
        host's ranges of them) from the source into the FP32 master and writes their BF16 copy. Every host reads
        the files itself. An error on any rank is raised on every rank, once all have stopped writing."""
        assert self.source is not None
        topo, units = self.topology, self.layout.units
        index, count = (0, 1) if topo.ledger_per_rank else (topo.local_rank, topo.ranks_per_host)
        ranges = self.host_ranges() or [(u.offset, u.offset + u.padded) for u in units]
        mine = balanced_shares([b - a for a, b in ranges], count)[index]
        work = [(u, self._pieces(units[u], self._names[u], *ranges[u])) for u in mine]
        total = sum(self.source.nbytes(name, n) for _, pieces in work for name, _, _, n in pieces)
        error: Exception | None = None
        what = f"SlideDP reading the checkpoint ({'1/' + str(count) + ' per rank' if count > 1 else 'all'})"
        bar = ByteProgress(what, total, show=topo.local_rank == 0)
        threads = numba.get_num_threads()
        try:  # the conversion kernels run on this rank's share of the cores, as the update kernels do
            budget = cpu_ops.thread_budget(count)
            cpu_ops.set_kernel_threads(budget)
            views = []
            for u, pieces in work:
                for region in ("master", "bf16"):
                    whole = ledger.region(region, u)
                    if whole is not None:
                        views += [whole[lo - units[u].offset : lo - units[u].offset + n] for _, _, lo, n in pieces]
            prepare_pages(ledger, ledger_spans(ledger, [v for v in views if v.numel()]), budget)
            with _paged(ledger):
                for u, pieces in work:
                    ranges_u = [ranges[i] if i == u else (ranges[i][0], ranges[i][0]) for i in range(len(units))]
                    ledger.clear_moments(ranges_u)
                    master, bf16 = ledger.region("master", u), ledger.region("bf16", u)
                    covered = ledger.extent("master", u)  # beyond: frozen weights, BF16 copy only
                    for name, start, lo, n in pieces:  # gaps and padding stay zero in both copies
                        lo -= units[u].offset
                        in_master = master is not None and lo + n <= covered
                        out = master[lo : lo + n] if in_master else torch.empty(n)  # type: ignore[index]
                        self.source.read_into(name, out, start, bf16[lo : lo + n] if bf16 is not None else None)
                        if master is None and lo < covered:  # the master on disk: through the state file's mapping
                            ledger.write_weights(u, lo, out)
                        bar.update(self.source.nbytes(name, n))
        except Exception as exc:  # raised below, after every rank has reported
            error = exc
        finally:
            seconds = bar.close()
            self.source.close()
            numba.set_num_threads(threads)
        mine_result = (None if error is None else f"{type(error).__name__}: {error}", total, seconds)
        results = [mine_result]
        if topo.job_group is not None:
            results = [None] * topo.world_size  # type: ignore[list-item]
            dist.all_gather_object(results, mine_result, group=topo.job_group)
        if error is not None:
            raise error
        failed = [(r, res[0]) for r, res in enumerate(results) if res[0] is not None]
        if failed:
            rank, message = failed[0]
            raise CheckpointError(f"rank {rank} could not read the checkpoint into its ledger: {message}")
        if topo.ledger_per_rank or topo.job_group is None:
            host = [mine_result]
        else:
            host = results[topo.host * topo.ranks_per_host : (topo.host + 1) * topo.ranks_per_host]
        self.report = LoadReport("checkpoint", sum(r[1] for r in host), max(r[2] for r in host), count)
        log.log(
            logging.INFO if topo.global_rank == 0 else logging.DEBUG,
            "SlideDP read %s into the ledger on %d rank(s) per host: %s",
            self.source.describe(),
            count,
            rate(self.report.nbytes, self.report.seconds),
        )


@contextmanager
def _paged(ledger: HostLedger) -> Iterator[None]:
    """Around writes of a master on disk through the state file's mapping: its pages handed back as they are
    written (a master larger than host memory is never mapped whole), and on the file at the end, before the update
    lane reads its records. Nothing to do with the master in memory."""
    if ledger.disk is None or not ledger.master_on_disk:
        yield
        return
    with ledger.disk.paged():
        yield
    ledger.disk.unmap()


def broadcast_weights(ledger: HostLedger, group: Any, **src: int) -> None:
    """Global rank 0's weights to every rank of ``group``: the whole master and the BF16 copies of what it does
    not cover (the other BF16 copies are refreshed from the master afterwards)."""
    g = ledger.geometry
    if ledger.master_on_disk:  # unit by unit through the state file (a master larger than host memory)
        source = src.get("src", src.get("group_src", 0))
        for u in range(g.num_units):
            flat = ledger.weights(u) if dist.get_rank() == source else torch.zeros(g.unit_sizes[u])
            dist.broadcast(flat, group=group, **src)  # type: ignore[arg-type]
            ledger.write_weights(u, 0, flat)
        assert ledger.disk is not None
        ledger.disk.unmap()
        return
    if ledger.master.numel():
        dist.broadcast(ledger.master, group=group, **src)  # type: ignore[arg-type]
    for u in range(g.num_units):
        covered = g.unit_elems("master", u)
        bf16 = ledger.region("bf16", u)
        if covered < g.unit_sizes[u] and bf16 is not None:
            dist.broadcast(bf16[covered:], group=group, **src)  # type: ignore[arg-type]
