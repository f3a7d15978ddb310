"""Streaming units and their flat layout: where every parameter lives in the ledger, and who owns which shard."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from slidedp_lightning.models.adapter import UnitSpec, UnsupportedModelError
from slidedp_lightning.models.structure import HiddenUse

log = logging.getLogger(__name__)

PARAM_ALIGN = 16  # elements (64 B of FP32): every parameter starts on a vector boundary
SHARD_ALIGN = 1024  # elements (one 4 KiB page of FP32): every rank shard starts on a page


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclass(frozen=True)
class ParamSlot:
    """One parameter inside a unit's flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int  # elements from the unit start
    numel: int
    locations: tuple[tuple[nn.Module, str], ...]  # every (module, attribute) holding it; >1 when tied
    trainable: bool = True  # False: frozen (requires_grad=False): no gradient, no update, weights untouched

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass
class Unit:
    """A set of parameters made resident and updated together (the embedding, one block, the head)."""

    index: int
    name: str
    slots: list[ParamSlot]
    padded: int  # flat length, a multiple of world_size * SHARD_ALIGN
    offset: int  # element offset of this unit in the ledger arrays
    world_size: int  # owners: ranks that split the unit into shards

    @property
    def trainable_slots(self) -> int:
        """Parameters of the unit that receive a gradient in each backward pass."""
        return sum(s.trainable for s in self.slots)

    @property
    def has_frozen(self) -> bool:
        """Some parameter of the unit is frozen."""
        return self.trainable_slots < len(self.slots)

    @property
    def frozen(self) -> bool:
        """Every parameter of the unit is frozen: it is never reduced nor updated."""
        return not self.trainable_slots

    @property
    def trainable_extent(self) -> int:
        """Unit-relative ``[0, E)`` that holds every trainable parameter: the ledger keeps moments (and, where the
        device reads the BF16 copy, an FP32 master) for this range only. ``padded`` without frozen parameters, 0
        when every parameter is frozen; with both, :func:`build_layout` lays the trainable ones out first and the
        frozen ones from a ``SHARD_ALIGN`` boundary on, which is ``E`` (else ``padded``: nothing is left out)."""
        if self.frozen:
            return 0
        if not self.has_frozen:
            return self.padded
        end = _round_up(max(s.end for s in self.slots if s.trainable), SHARD_ALIGN)
        return end if all(s.trainable or s.offset >= end for s in self.slots) else self.padded

    @property
    def shard_numel(self) -> int:
        return self.padded // self.world_size

    def shard(self, rank: int) -> tuple[int, int]:
        """Unit-relative [start, end) of ``rank``'s shard."""
        n = self.shard_numel
        return rank * n, (rank + 1) * n

    def gaps(self) -> list[tuple[int, int]]:
        """Unit-relative ranges that belong to no parameter (alignment and tail padding)."""
        out, pos = [], 0
        for slot in self.slots:
            if slot.offset > pos:
                out.append((pos, slot.offset))
            pos = slot.end
        if pos < self.padded:
            out.append((pos, self.padded))
        return out


@dataclass
class Layout:
    """All units of a model in forward order, and the compute modules that need each unit."""

    units: list[Unit]
    total: int  # padded elements over all units
    world_size: int
    compute_modules: list[tuple[nn.Module, tuple[int, ...]]] = field(default_factory=list)
    # modules outside every unit whose forward reads units' parameters through attributes the module tree does not
    # show (see models.structure.hidden_uses): those units stay resident around their calls, and for backward
    borrowers: list[tuple[nn.Module, tuple[int, ...]]] = field(default_factory=list)

    @property
    def num_params(self) -> int:
        return sum(s.numel for u in self.units for s in u.slots)

    @property
    def num_trainable(self) -> int:
        return sum(s.numel for u in self.units for s in u.slots if s.trainable)

    @property
    def max_unit(self) -> int:
        return max(u.padded for u in self.units)

    def slots(self) -> list[tuple[Unit, ParamSlot]]:
        return [(u, s) for u in self.units for s in u.slots]


def _param_locations(root: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    where: dict[int, list[tuple[nn.Module, str]]] = {}
    seen_modules: set[int] = set()
    for _, module in root.named_modules(remove_duplicate=False):
        if id(module) in seen_modules:
            continue
        seen_modules.add(id(module))
        for attr, p in module.named_parameters(recurse=False, remove_duplicate=False):
            where.setdefault(id(p), []).append((module, attr))
    return where


def build_layout(
    root: nn.Module,
    specs: list[UnitSpec],
    world_size: int,
    owners: int | None = None,
    hidden: Sequence[HiddenUse] = (),
) -> Layout:
    """Assign every parameter of ``root`` to the first unit whose modules contain it, and lay units out flat.

    Units are padded for ``world_size`` ranks and split into ``owners`` shards (default: one per rank; the
    replicated baseline has a single owner but keeps the same layout, so every mode computes on the same
    memory geometry).

    Frozen parameters (``requires_grad=False``) keep their slot (the ledger holds their weights, see
    ``ledger.geometry.unit_regions``) with ``trainable=False``; in a unit with both kinds they come after the trainable
    ones (:attr:`Unit.trainable_extent`). Raises :class:`UnsupportedModelError` for parameters outside
    every unit.

    ``hidden``: parameters read through plain attributes (a tie the module tree does not show): the compute module
    around the holder (or, outside every unit, the holder itself) also makes their units resident.
    """
    names = {id(p): n for n, p in root.named_parameters()}
    locations = _param_locations(root)
    owner: dict[int, int] = {}
    units: list[Unit] = []
    offset = 0
    for spec in specs:
        params: list[nn.Parameter] = []
        for module in spec.modules:
            for p in module.parameters():
                if id(p) in owner or id(p) not in names:
                    continue
                owner[id(p)] = len(units)
                params.append(p)
        # trainable parameters first; frozen ones (if any, beside trainable ones) from a shard boundary on
        trainable = [p for p in params if p.requires_grad]
        frozen = [p for p in params if not p.requires_grad]
        slots: list[ParamSlot] = []
        pos = 0
        for i, p in enumerate(trainable + frozen):
            if i == len(trainable) > 0:  # the first frozen one after trainable ones
                pos = _round_up(pos, SHARD_ALIGN)
            pos = _round_up(pos, PARAM_ALIGN)
            slots.append(
                ParamSlot(names[id(p)], tuple(p.shape), pos, p.numel(), tuple(locations[id(p)]), p.requires_grad)
            )
            pos += p.numel()
        if not slots:
            continue
        padded = _round_up(max(pos, 1), world_size * SHARD_ALIGN)
        units.append(Unit(len(units), spec.name, slots, padded, offset, owners or world_size))
        offset += padded
    missing = [n for i, n in names.items() if i not in owner]
    if missing:
        raise UnsupportedModelError(
            f"Parameters {missing[:5]} are outside the streamed model's units. SlideDP streams the model's "
            "embedding, decoder blocks and head; keep other trainable parameters out of the LightningModule."
        )
    compute: dict[int, tuple[nn.Module, set[int]]] = {}
    for spec in specs:
        for module in spec.modules:
            needed = {owner[id(p)] for p in module.parameters() if id(p) in owner}
            if needed:
                compute.setdefault(id(module), (module, set()))[1].update(needed)
    borrowers: dict[int, tuple[nn.Module, set[int]]] = {}
    for use in hidden:
        borrowed = {owner[id(p)] for p in use.params if id(p) in owner}
        around = [m for m, _ in compute.values() if any(sub is use.holder for sub in m.modules())]
        if around:  # the innermost compute module that contains the holder runs its calls
            target = min(around, key=lambda m: sum(1 for _ in m.modules()))
            compute[id(target)][1].update(borrowed)
        else:
            borrowers.setdefault(id(use.holder), (use.holder, set()))[1].update(borrowed)
        log.info(
            "SlideDP: %s reads %s outside the module tree (a tie through a plain attribute): unit(s) %s stay on "
            "the device around its calls",
            use.where,
            ", ".join(names[id(p)] for p in use.params[:3]) + (" ..." if len(use.params) > 3 else ""),
            ", ".join(units[u].name for u in sorted(borrowed)),
        )

    def listed(entries: dict[int, tuple[nn.Module, set[int]]]) -> list[tuple[nn.Module, tuple[int, ...]]]:
        return [(m, tuple(sorted(us))) for m, us in entries.values()]

    return Layout(units, offset, owners or world_size, listed(compute), listed(borrowers))
