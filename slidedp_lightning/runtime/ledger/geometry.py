"""The host ledger's geometry: which regions it has, where each unit lies in each, and what it costs.

Pure arithmetic (no file, no mapping): :class:`~slidedp_lightning.runtime.ledger.host_ledger.HostLedger` maps a file of
this shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slidedp_lightning.constants import QUANT_BLOCK

PAGE = 4096
GUARD = PAGE  # bytes left between the arrays so they never sit at power-of-two distances

# Every per-element region a ledger may have, in file order: (dtype, unit elements per region element).
_FP32 = {"master": (torch.float32, 1), "exp_avg": (torch.float32, 1), "exp_avg_sq": (torch.float32, 1)}
_INT8 = {
    "master": (torch.float32, 1),
    "exp_avg": (torch.uint8, 1),  # block-wise 8-bit codes (cpu_ops.adamw8: signed map)
    "exp_avg_sq": (torch.uint8, 1),  # (unsigned map)
    "exp_avg_absmax": (torch.float32, QUANT_BLOCK),  # one FP32 scale per block of QUANT_BLOCK elements
    "exp_avg_sq_absmax": (torch.float32, QUANT_BLOCK),
}
_BF16 = {"bf16": (torch.bfloat16, 1)}
ALL_REGIONS: tuple[str, ...] = ("master", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax", "bf16")
MOMENTS: tuple[str, ...] = ("exp_avg", "exp_avg_sq")


def _page(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def region_specs(optimizer_state: str = "fp32") -> dict[str, tuple[torch.dtype, int]]:
    """The regions of a ledger whose moments are ``optimizer_state`` ("fp32" or "int8"), in file order."""
    if optimizer_state not in ("fp32", "int8"):
        raise ValueError(f"optimizer_state must be 'fp32' or 'int8', got {optimizer_state!r}")
    return {**(_INT8 if optimizer_state == "int8" else _FP32), **_BF16}


def unit_regions(
    trainable: bool, compute_dtype: torch.dtype, optimizer_state: str = "fp32", bf16_copy: bool = True
) -> tuple[str, ...]:
    """The regions a unit keeps. A unit with a trainable parameter: master, moments (with their scales under
    int8) and, unless ``bf16_copy`` is off, the BF16 copy. A wholly frozen unit has no moments and keeps one copy
    of its weights, the one the device reads: the BF16 copy under bf16 compute (when kept), else the master."""
    if trainable:
        return tuple(r for r in region_specs(optimizer_state) if bf16_copy or r != "bf16")
    return ("bf16",) if compute_dtype == torch.bfloat16 and bf16_copy else ("master",)


@dataclass(frozen=True)
class LedgerGeometry:
    """Sizes and byte offsets of everything in one ledger file.

    Each region (``master``, ``exp_avg``, ``exp_avg_sq``, ``bf16``) holds the units that have it back to back, in
    unit order; a unit has an element offset in each region it has (:meth:`unit_offsets`). Without
    ``unit_sizes`` the units are not described and every region holds ``total`` elements."""

    total: int  # padded parameter count over all units (elements of a region every unit has)
    num_units: int
    world_size: int
    staging_slots: int  # host_reduce gradient slots per rank (0 when the route is gpu_reduce)
    staging_elems: int  # elements per staging slot
    staging_itemsize: int  # 4 for FP32 gradients, 2 for BF16
    unit_sizes: tuple[int, ...] = ()  # padded elements of each unit
    regions_of_unit: tuple[tuple[str, ...], ...] = ()  # the regions each unit has (empty: all of them)
    optimizer_state: str = "fp32"  # the moments' form: "fp32" or "int8" (codes + per-block scales)
    # elements of each unit's trainable prefix (``Unit.trainable_extent``; empty: every unit whole): the moments
    # cover only that prefix, and so does the master when ``trim_master`` (the device reads the BF16 copy, which
    # alone keeps the frozen parameters' weights)
    trainable_sizes: tuple[int, ...] = ()
    trim_master: bool = False
    # regions kept in a state file on a local disk instead of this file (``runtime.ledger.disk``): they keep their
    # per-unit extents (:meth:`unit_elems`) but take no bytes here (:meth:`mapped_elems`)
    on_disk: tuple[str, ...] = ()

    @property
    def specs(self) -> dict[str, tuple[torch.dtype, int]]:
        """Region name -> (dtype, unit elements per region element), in file order."""
        return region_specs(self.optimizer_state)

    def dtype(self, name: str) -> torch.dtype:
        return self.specs[name][0]

    def _elems(self, name: str, size: int) -> int:
        return size // self.specs[name][1]

    def __post_init__(self) -> None:
        if self.unit_sizes and (len(self.unit_sizes) != self.num_units or sum(self.unit_sizes) != self.total):
            raise ValueError(
                f"unit_sizes {self.unit_sizes[:4]}... do not add up to {self.num_units} units, {self.total}"
            )
        if self.regions_of_unit and len(self.regions_of_unit) != len(self.unit_sizes):
            raise ValueError("regions_of_unit needs one entry per unit of unit_sizes")
        if any(name not in self.specs for name in self.on_disk):
            raise ValueError(f"on_disk names regions this ledger does not have: {self.on_disk}")
        if self.trainable_sizes and (
            len(self.trainable_sizes) != len(self.unit_sizes)
            or any(t > n or t % QUANT_BLOCK for t, n in zip(self.trainable_sizes, self.unit_sizes))
        ):
            raise ValueError("trainable_sizes needs one QUANT_BLOCK multiple per unit, none above the unit's size")

    def unit_elems(self, name: str, unit: int) -> int:
        """Unit-relative elements that ``unit``'s range in region ``name`` covers, from the unit's start (0: none)."""
        if not self.has(name, unit):
            return 0
        if self.trainable_sizes and name != "bf16" and (name != "master" or self.trim_master):
            return self.trainable_sizes[unit]
        return self.unit_sizes[unit]

    def has(self, name: str, unit: int) -> bool:
        """Whether ``unit`` has a range in region ``name``."""
        return name in self.specs and (not self.regions_of_unit or name in self.regions_of_unit[unit])

    def unit_offsets(self, name: str) -> tuple[int | None, ...]:
        """Element offset of every unit inside region ``name`` (None: the unit is not in it)."""
        if not self.unit_sizes:
            raise ValueError("this ledger geometry does not describe its units (no unit_sizes)")
        out: list[int | None] = []
        pos = 0
        for u in range(self.num_units):
            if self.has(name, u):
                out.append(pos)
                pos += self._elems(name, self.unit_elems(name, u))
            else:
                out.append(None)
        return tuple(out)

    def layout_offsets(self) -> tuple[int, ...]:
        """Element offset of every unit in the layout (``Unit.offset``: as if every unit had every region)."""
        out, pos = [], 0
        for size in self.unit_sizes:
            out.append(pos)
            pos += size
        return tuple(out)

    def region_elems(self, name: str) -> int:
        """Elements of region ``name``."""
        if name not in self.specs:
            return 0
        if not self.unit_sizes:
            return self._elems(name, self.total)
        return sum(self._elems(name, self.unit_elems(name, u)) for u in range(self.num_units))

    def mapped_elems(self, name: str) -> int:
        """Elements of region ``name`` in the ledger file (0 for a region kept on disk)."""
        return 0 if name in self.on_disk else self.region_elems(name)

    def itemsize(self, name: str) -> int:
        return torch.empty(0, dtype=self.dtype(name)).element_size()

    def unit_bytes(self, unit: int, lo: int = 0, hi: int | None = None) -> int:
        """Bytes of every region range of ``unit`` (padding included, guards not), of unit-relative ``[lo, hi)``
        only when given (a QUANT_BLOCK multiple each)."""
        hi = self.unit_sizes[unit] if hi is None else hi
        return sum(
            self._elems(r, max(0, min(hi, self.unit_elems(r, unit)) - lo)) * self.itemsize(r) for r in self.specs
        )

    def _stamp_elems(self) -> int:
        r, u, k = self.world_size, self.num_units, self.staging_slots
        return 2 * u * r + r + r * k + r * r * k + 8

    @property
    def offsets(self) -> dict[str, int]:
        off, pos = {}, 0
        sizes = [("stamps", self._stamp_elems() * 8)]
        sizes += [(name, self.mapped_elems(name) * self.itemsize(name)) for name in self.specs]
        sizes += [("staging", self.staging_bytes)]
        for name, nbytes in sizes:
            off[name] = pos
            pos = _page(pos + nbytes) + (GUARD if nbytes else 0)
        off["end"] = pos
        return off

    @property
    def nbytes(self) -> int:
        return self.offsets["end"]

    @property
    def staging_bytes(self) -> int:
        return self.world_size * self.staging_slots * self.staging_elems * self.staging_itemsize


@dataclass(frozen=True)
class LedgerStats:
    """What one host's ledger holds, for reports and benchmarks (the public read interface of its size).

    ``trainable_*`` counts the trainable parameters and the region ranges of the units' trainable prefixes
    (``Unit.trainable_extent``), ``frozen_*`` the frozen parameters and the rest of the units' ranges, padding
    included (stamps, guards and staging are in ``nbytes`` only)."""

    nbytes: int  # the file's size: every region, padding and guards included
    num_params: int  # model parameters it holds (each tied parameter once)
    padded_params: int  # elements per array, alignment and shard padding included
    allocated_bytes: int  # memory the file holds now (a page is allocated when first written)
    copies: float  # ledgers of this size per host: 1; R for the replicated route; 1/N when host-sharded
    trainable_params: int = 0
    trainable_bytes: int = 0
    frozen_params: int = 0
    frozen_bytes: int = 0

    @property
    def bytes_per_param(self) -> float:
        return self.nbytes / self.num_params if self.num_params else 0.0

    @property
    def trainable_bytes_per_param(self) -> float:
        return self.trainable_bytes / self.trainable_params if self.trainable_params else 0.0

    @property
    def frozen_bytes_per_param(self) -> float:
        return self.frozen_bytes / self.frozen_params if self.frozen_params else 0.0
