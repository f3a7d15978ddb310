"""The host ledger: one FP32 master, two Adam moments and a BF16 transfer copy per host, in shared memory.

One process (local rank 0) creates an unnamed file, every local rank opens and maps it (:mod:`~slidedp_lightning.runtime.ledger.memory`):
the memory lives exactly as long as the processes using it, so a crashed or killed rank can never leak it. A
ledger that only its own process maps (one local rank, or one ledger per rank) is that process's private memory
instead, unless ``$SLIDEDP_SHM_DIR`` names a directory for it (:func:`~slidedp_lightning.runtime.ledger.preflight.ledger_directory`).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from slidedp_lightning.runtime.host_os import format_bytes
from slidedp_lightning.runtime.ledger.disk import DiskState
from slidedp_lightning.runtime.ledger.geometry import (
    ALL_REGIONS,
    MOMENTS,
    LedgerGeometry,
)
from slidedp_lightning.runtime.ledger.memory import LedgerFile, LedgerHandle, PrivateLedgerMemory
from slidedp_lightning.runtime.ledger.preflight import _where_ledgers_go

log = logging.getLogger(__name__)

# ledger mappings that device copies may still use (closed after an error): referenced until the process exits
_HELD_UNTIL_EXIT: list[torch.Tensor] = []


class HostLedger:
    """Shared-memory arrays of one host.

    Tensors (torch views of the shared mapping): ``master``, ``exp_avg``, ``exp_avg_sq`` (FP32),
    ``bf16`` (BF16 transfer copy), each a whole region (the units that have it, back to back; :meth:`region` is
    one unit's range; empty when no unit has it) and, for ``host_reduce``, ``staging`` (per-rank gradient slots).
    Stamps (int64 numpy views, written by one process, read by all): ``version[unit, owner]`` = updates
    applied; ``written[unit, owner]`` = updates whose records the state file holds (regions on disk: an update's
    records are written back after its version is stamped); ``pids[rank]``; ``grad_gen[rank, slot]`` = watermark
    of a staging slot (generation * 2**32 + elements written so far, see grads.WATERMARK);
    ``consumed[owner, writer, slot]`` = generation an owner has finished reading.
    """

    def __init__(
        self, source: str | LedgerHandle | None, geometry: LedgerGeometry, *, create: bool, share: bool = False
    ) -> None:
        """``create``: a new file in the directory ``source`` (``share``: other ranks will open it, from
        :attr:`handle`), or with ``source`` None this process's private memory (never shared); else the creator's
        file, from its ``source`` handle."""
        self.geometry = geometry
        self.owner = create
        self._pinned_at: list[int] = []  # the page-locked ranges' addresses (pin())
        self.file: LedgerFile | PrivateLedgerMemory
        if create and source is None:
            assert not share, "a private ledger cannot be shared"
            self.file = PrivateLedgerMemory(geometry.nbytes)
        elif create:
            assert isinstance(source, str), "a new ledger is created in a directory"
            try:
                self.file = LedgerFile.create(source, geometry.nbytes, "slidedp-ledger", share=share)
            except OSError as err:
                raise _where_ledgers_go(err) from err
        else:
            assert isinstance(source, LedgerHandle), "an existing ledger is opened from its creator's handle"
            self.file = LedgerFile.open(source)
        self._open = True
        if isinstance(self.file, PrivateLedgerMemory):
            assert self.file.memory is not None
            raw = torch.frombuffer(self.file.memory, dtype=torch.uint8)  # holds the mapping while any view lives
            self._raw = raw[: geometry.nbytes]
        else:
            self._raw = torch.from_file(self.file.path, shared=True, size=geometry.nbytes, dtype=torch.uint8)
        off = geometry.offsets
        g = geometry

        def view(name: str, count: int, dtype: torch.dtype) -> torch.Tensor:
            itemsize = torch.empty(0, dtype=dtype).element_size()
            return self._raw[off[name] : off[name] + count * itemsize].view(dtype)

        # each region whole: the units that have it, back to back (empty where no unit has it, or the mode has none:
        # the absmax regions exist with optimizer_state="int8" only)
        self.master = self.exp_avg = self.exp_avg_sq = self.bf16 = torch.empty(0)
        self.exp_avg_absmax = self.exp_avg_sq_absmax = torch.empty(0)
        for name, (dtype, _) in g.specs.items():
            setattr(self, name, view(name, g.mapped_elems(name), dtype))
        self._unit_offsets: dict[str, tuple[int | None, ...]] | None = None
        if g.unit_sizes:
            none = (None,) * g.num_units
            self._unit_offsets = {
                name: g.unit_offsets(name) if name in g.specs and name not in g.on_disk else none
                for name in ALL_REGIONS
            }
        # the regions kept in a state file on a local disk (``geometry.on_disk``), attached by open_ledger
        self.disk: DiskState | None = None
        stamps = view("stamps", g._stamp_elems(), torch.int64).numpy()
        r, u, k = g.world_size, g.num_units, g.staging_slots
        pos = 0

        def take(shape: tuple[int, ...]) -> np.ndarray:
            nonlocal pos
            size = int(np.prod(shape))
            out = stamps[pos : pos + size].reshape(shape)
            pos += size
            return out

        self.version = take((u, r))
        self.written = take((u, r))
        self.pids = take((r,))
        self.grad_gen = take((r, k))
        self.consumed = take((r, r, k))
        self.staging: torch.Tensor | None = None
        if k:
            sdtype = torch.float32 if g.staging_itemsize == 4 else torch.bfloat16
            self.staging = view("staging", r * k * g.staging_elems, sdtype).view(r, k, g.staging_elems)

    def region(self, name: str, unit: int) -> torch.Tensor | None:
        """The padded range of ``unit`` (its index) in region ``name`` (``master``, ``exp_avg``, ``exp_avg_sq``,
        their ``*_absmax`` scales under int8, ``bf16``), a view of the shared mapping (a scale region: one element
        per block); None when the unit has no range there (a wholly frozen unit keeps neither moments nor, under
        bf16 compute, an FP32 master; no unit has a BF16 copy with ``bf16_copy=False``; a region kept on disk,
        ``geometry.on_disk``, is read and written through :attr:`disk` only)."""
        if self._unit_offsets is None:
            raise ValueError("this ledger's geometry does not describe its units: region() needs unit_sizes")
        start = self._unit_offsets[name][unit]
        if start is None:
            return None
        whole = getattr(self, name)
        return whole[start : start + self.geometry.unit_elems(name, unit) // self.geometry.specs[name][1]]

    def extent(self, name: str, unit: int) -> int:
        """Unit-relative elements ``[0, extent)`` that ``unit``'s range in region ``name`` covers (0: none; less than
        the unit where its frozen parameters keep no moments or master, see ``LedgerGeometry.trainable_sizes``)."""
        return self.geometry.unit_elems(name, unit)

    def np_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The four whole regions as numpy views (BF16 as raw uint16 bits); every unit must have every region."""
        return (
            self.master.numpy(),
            self.exp_avg.numpy(),
            self.exp_avg_sq.numpy(),
            self.bf16.view(torch.int16).numpy().view(np.uint16),
        )

    def region_np(self, name: str, unit: int) -> np.ndarray | None:
        """:meth:`region` as a numpy view for the kernels (BF16 as raw uint16 bits)."""
        t = self.region(name, unit)
        if t is None:
            return None
        return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()

    def clear_moments(self, ranges: list[tuple[int, int]] | None = None) -> None:
        """int8 moments: write the code of 0 everywhere (or in ``ranges``, per unit in layout elements): a new file
        reads as zero bytes, which is the code of -1 in exp_avg's signed map. No-op under fp32."""
        g = self.geometry
        if g.optimizer_state != "int8":
            return
        from cpu_ops.adamw8 import quantize_blockwise

        zero = {
            name: int(quantize_blockwise(np.zeros(1, np.float32), signed=name == "exp_avg")[0][0]) for name in MOMENTS
        }
        starts = g.layout_offsets()
        for u in range(g.num_units):
            a, b = (0, g.unit_sizes[u]) if ranges is None else (ranges[u][0] - starts[u], ranges[u][1] - starts[u])
            for name in MOMENTS:
                codes = self.region(name, u)
                if codes is not None:
                    codes[a : min(b, codes.numel())].fill_(zero[name])

    @property
    def master_on_disk(self) -> bool:
        """Whether the FP32 master lives in the state file (:attr:`disk`), read and written through it only."""
        return "master" in self.geometry.on_disk

    def weights(self, unit: int) -> torch.Tensor:
        """The unit's weights in FP32: its master, or a copy of it with what the master does not cover (a frozen
        unit or frozen tail keeping only its BF16 copy) converted from the BF16 copy (a master on disk: read into
        the copy)."""
        master = self.region("master", unit)
        if master is not None and master.numel() == self.geometry.unit_sizes[unit]:
            return master
        bf16 = self.region("bf16", unit)
        assert bf16 is not None, "every unit keeps its master or its BF16 copy"
        out = bf16.float()
        if master is not None:
            out[: master.numel()] = master
        elif self.master_on_disk and (covered := self.extent("master", unit)):
            assert self.disk is not None
            self.disk.read_range("master", unit, 0, out[:covered])
        return out

    def write_weights(self, unit: int, start: int, values: torch.Tensor) -> None:
        """Write FP32 ``values`` at unit-relative ``start`` of ``unit``'s weights: into the master where it covers
        them (a master on disk: through the state file's mapping, on the file at ``disk.unmap()``), into the BF16
        copy (rounded) where it does not. The master's BF16 copy is not refreshed here."""
        end = start + values.numel()
        master = self.region("master", unit)
        cut = min(max(self.extent("master", unit), start), end)
        if cut > start and master is not None:
            master[start:cut].copy_(values[: cut - start])
        elif cut > start:
            assert self.disk is not None and self.master_on_disk
            self.disk.write_range("master", unit, start, values[: cut - start])
        if end > cut:
            bf16 = self.region("bf16", unit)
            assert bf16 is not None, "every unit keeps its master or its BF16 copy"
            bf16[cut:end].copy_(values[cut - start :])

    def pin(self, ranges: list[tuple[int, int]]) -> bool:
        """Page-lock the byte ``ranges`` of this process's mapping (whole pages, not overlapping: see
        :func:`~slidedp_lightning.runtime.ledger.pages.lock_ranges`), the parts device copies read or write, so those copies are async DMA.
        Only those: page-locking faults every page in, so locking the whole mapping would hold the moments locked
        and, in a host-sharded ledger, allocate the pages this host never holds. Returns False (and logs why) when
        CUDA refuses; copies then stage through pageable memory."""
        if self._pinned_at:
            raise RuntimeError("this ledger is page-locked already")
        cudart = torch.cuda.cudart()
        base = self._raw.data_ptr()
        for a, b in ranges:
            err = cudart.cudaHostRegister(base + a, b - a, 0)
            code = getattr(err, "value", err)
            if code != 0:
                log.warning(
                    "cudaHostRegister of %s of the %s ledger failed (cudaError %s); copies will be synchronous",
                    format_bytes(b - a),
                    format_bytes(self.geometry.nbytes),
                    code,
                )
                self.unpin()
                return False
            self._pinned_at.append(base + a)
        log.info(
            "page-locked %s of the %s ledger in %d range(s) for device copies",
            format_bytes(sum(b - a for a, b in ranges)),
            format_bytes(self.geometry.nbytes),
            len(ranges),
        )
        return True

    def unpin(self) -> None:
        held, self._pinned_at = self._pinned_at, []
        if held:
            cudart = torch.cuda.cudart()
            for ptr in held:
                cudart.cudaHostUnregister(ptr)

    def refresh_bf16(self, ranges: list[tuple[int, int]] | None = None) -> None:
        """Rewrite the BF16 transfer copy from the master (torch's conversion: round-to-nearest-even, the same
        bits as the update kernel's; runs on the calling thread with torch's threads, no Numba), everywhere or
        in ``ranges`` only: one ``[a, b)`` per unit in layout elements (``Unit.offset`` based; a host-sharded
        ledger never touches the pages it does not own). Units without a master or a BF16 copy are skipped, and so
        are the elements the master does not cover (their BF16 copy is their only one)."""
        g = self.geometry
        if self.master_on_disk:
            self._refresh_bf16_from_disk(ranges)
            return
        whole = not g.trainable_sizes and (
            not g.regions_of_unit or all(g.has("master", u) and g.has("bf16", u) for u in range(g.num_units))
        )
        if ranges is None and whole:
            self.bf16.copy_(self.master)
            return
        if not g.unit_sizes:  # units not described: every region is laid out as the layout
            for a, b in ranges or [(0, g.total)]:
                self.bf16[a:b].copy_(self.master[a:b])
            return
        if ranges is None:
            ranges = [(a, a + n) for a, n in zip(g.layout_offsets(), g.unit_sizes)]
        for u, ((a, b), start) in enumerate(zip(ranges, g.layout_offsets())):
            master, bf16 = self.region("master", u), self.region("bf16", u)
            if master is not None and bf16 is not None:
                lo, hi = a - start, min(b - start, master.numel())
                if lo < hi:
                    bf16[lo:hi].copy_(master[lo:hi])

    def _refresh_bf16_from_disk(self, ranges: list[tuple[int, int]] | None) -> None:
        """:meth:`refresh_bf16` from a master on disk: record by record through the state file's mapping, its pages
        handed back as it goes (a master larger than host memory never sits there whole)."""
        disk, g = self.disk, self.geometry
        assert disk is not None
        starts = g.layout_offsets()
        with disk.paged():
            for u in range(g.num_units):
                bf16 = self.region("bf16", u)
                a, b = (0, g.unit_sizes[u]) if ranges is None else (ranges[u][0] - starts[u], ranges[u][1] - starts[u])
                b = min(b, self.extent("master", u))
                if bf16 is not None and a < b:
                    disk.read_range("master", u, a, bf16[a:b])  # torch's rounding, as refresh_bf16's
        disk.unmap()

    def mapping_address(self) -> int:
        """The address of the mapping's first byte (file offset 0)."""
        return self._raw.data_ptr()

    @property
    def handle(self) -> LedgerHandle:
        """What the other ranks of the host open this ledger from (its creator only)."""
        return self.file.handle()

    def allocated_bytes(self) -> int:
        """Bytes of memory the ledger holds now (a page is allocated when first written)."""
        assert self._open, "the ledger is closed"
        return self.file.allocated_bytes()

    def stop_sharing(self) -> None:
        """Every rank of the host has the file now: stop handing its descriptor out."""
        self.file.stop_sharing()

    def close(self, copies_done: bool = True) -> None:
        """Unpin and let go of the mapping. ``copies_done`` False (device copies into or out of it may still be
        running, after an error): a page-locked mapping stays locked and mapped until the process exits, since
        DMA into pages that were given back would write into memory that is someone else's by then."""
        if copies_done or not self._pinned_at:
            self.unpin()
        else:
            _HELD_UNTIL_EXIT.append(self._raw)
            self._pinned_at = []
            log.warning(
                "SlideDP: device copies of the %s ledger were still running at close; it stays mapped and "
                "page-locked until this process exits",
                format_bytes(self.geometry.nbytes),
            )
        disk, self.disk = getattr(self, "disk", None), None
        if disk is not None:
            disk.close()
        file = getattr(self, "file", None)  # absent when __init__ failed before opening it
        if file is not None:
            file.close()
            self._open = False
        for name in (*ALL_REGIONS, "staging", "_raw"):
            setattr(self, name, None)
