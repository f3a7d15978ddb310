"""Ledger state on a local disk: an unnamed file in a directory, read and written in aligned pieces.

For state too large for host memory (the FP32 master and the Adam moments, paper arXiv 2609.34162 and
docs/ledger.md): local rank 0 creates an unnamed file (``O_TMPFILE``, never linked to a name, so it is gone when the
last process holding it ends, however it ends) and reserves its blocks at once (``posix_fallocate``: a disk too
small is refused before any step, and no write can later fail for space); the other ranks open it as they open the
ledger (:class:`~slidedp_lightning.runtime.ledger.memory.LedgerFile`). Each process reads and writes it through its
own descriptor with ``O_DIRECT`` where the filesystem allows (no page-cache copy: the host memory the state takes is
the bounded :class:`AlignedPool`), else buffered, said once in the log. Every I/O error names the file's directory,
the operation, offset and size.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from slidedp_lightning.constants import QUANT_BLOCK
from slidedp_lightning.runtime.host_os import format_bytes
from slidedp_lightning.runtime.ledger.geometry import MOMENTS, LedgerGeometry
from slidedp_lightning.runtime.ledger.memory import NO_TMPFILE, LedgerFile, LedgerHandle

log = logging.getLogger(__name__)

ALIGN = 4096  # offsets, lengths and buffer addresses of direct I/O: a multiple of every logical block size in use


class DiskStateError(OSError):
    """The state file cannot be created, or an I/O on it failed; the message names the directory and what to do."""


def aligned_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged process may still allocate on ``directory``'s filesystem."""
    return shutil.disk_usage(directory).free


class StateFile:
    """This process's direct-I/O view of the unnamed state file (``file``: the shared descriptor it came from)."""

    def __init__(self, file: LedgerFile, directory: str) -> None:
        self.file = file
        self.directory = directory
        self.nbytes = file.nbytes
        try:
            self.fd = os.open(file.path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
            self.direct = True
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            self.fd = os.open(file.path, os.O_RDWR | os.O_CLOEXEC)
            self.direct = False
            log.warning("SlideDP: %s does not support direct I/O; the state file is read and written through the "
                        "page cache, which then holds up to the file's size of host memory", directory)  # fmt: skip

    @classmethod
    def create(cls, directory: str, nbytes: int, *, share: bool) -> StateFile:
        """A new unnamed file of ``nbytes`` (rounded up to :data:`ALIGN`) in ``directory``, its blocks reserved; a
        directory that does not exist, cannot hold unnamed files or has too little free space is refused, with the
        numbers and what to do, before anything is written."""
        nbytes = aligned_up(nbytes)
        if not os.path.isdir(directory):
            raise DiskStateError(errno.ENOENT, f"SlideDP state directory {directory} does not exist")
        free = free_bytes(directory)
        if free < nbytes:
            raise DiskStateError(
                errno.ENOSPC,
                f"SlideDP state directory {directory} has {format_bytes(free)} free, the state file needs "
                f"{format_bytes(nbytes)}: free {format_bytes(nbytes - free)} there or choose a larger local disk",
            )
        try:
            file = LedgerFile.create(directory, nbytes, "slidedp-state", share=share, memfd_fallback=False)
        except OSError as err:
            if err.errno in NO_TMPFILE:
                raise DiskStateError(
                    err.errno,
                    f"SlideDP state directory {directory}: its filesystem cannot hold unnamed files (O_TMPFILE: "
                    f"{err.strerror}); choose a directory on a local ext4, xfs or btrfs disk",
                ) from err
            raise DiskStateError(err.errno, f"SlideDP state directory {directory}: {err.strerror}") from err
        try:
            assert file.fd is not None
            os.posix_fallocate(file.fd, 0, nbytes)
        except OSError as err:
            file.close()
            raise DiskStateError(
                err.errno, f"SlideDP could not reserve {format_bytes(nbytes)} in {directory}: {err.strerror}"
            ) from err
        state = cls(file, directory)
        log.info("SlideDP state file: an unnamed file of %s in %s, never linked to a name, its blocks reserved; %s I/O",
                 format_bytes(nbytes), directory, "direct" if state.direct else "buffered")  # fmt: skip
        return state

    def _check(self, offset: int, buf: np.ndarray) -> memoryview:
        if not buf.flags.c_contiguous:
            raise ValueError("the state file reads into and writes from contiguous arrays only")
        view = buf.data.cast("B")
        if self.direct and (offset % ALIGN or view.nbytes % ALIGN or buf.ctypes.data % ALIGN):
            raise ValueError(
                f"direct I/O needs offset, size and address aligned to {ALIGN} bytes: offset {offset}, "
                f"{view.nbytes} bytes at {buf.ctypes.data:#x}"
            )
        if offset < 0 or offset + view.nbytes > self.nbytes:
            raise ValueError(f"[{offset}, {offset + view.nbytes}) is outside the state file's {self.nbytes} bytes")
        return view

    def read_into(self, offset: int, buf: np.ndarray) -> None:
        """Fill contiguous ``buf`` with the file's bytes from ``offset`` (the GIL is released while it waits)."""
        view = self._check(offset, buf)
        done = 0
        while done < view.nbytes:
            try:
                n = os.preadv(self.fd, [view[done:]], offset + done)
            except OSError as err:
                raise self._error("read", offset, view.nbytes, err) from err
            if n == 0:
                raise self._error("read", offset, view.nbytes, OSError(errno.EIO, "unexpected end of file"))
            done += n

    def write_from(self, offset: int, buf: np.ndarray) -> None:
        """Write contiguous ``buf`` to the file at ``offset``."""
        view = self._check(offset, buf)
        done = 0
        while done < view.nbytes:
            try:
                done += os.pwritev(self.fd, [view[done:]], offset + done)
            except OSError as err:
                raise self._error("write", offset, view.nbytes, err) from err

    def _error(self, op: str, offset: int, nbytes: int, err: OSError) -> DiskStateError:
        return DiskStateError(
            err.errno,
            f"SlideDP state file in {self.directory}: {op} of {format_bytes(nbytes)} at byte {offset} failed: "
            f"{err.strerror}",
        )

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None  # type: ignore[assignment]
        self.file.close()


class AlignedPool:
    """``count`` page-aligned buffers of ``nbytes`` each (anonymous mappings): the only host memory the state's
    I/O uses. :meth:`get` blocks while all are in use, which bounds how far reads run ahead of the update."""

    def __init__(self, count: int, nbytes: int) -> None:
        if count < 1 or nbytes < 1:
            raise ValueError(f"an aligned pool needs at least one buffer of at least one byte, got {count} x {nbytes}")
        self.nbytes = aligned_up(nbytes)
        self._maps = [mmap.mmap(-1, self.nbytes) for _ in range(count)]
        self._free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        for m in self._maps:
            self._free.put(np.frombuffer(m, np.uint8))

    @property
    def count(self) -> int:
        return len(self._maps)

    def get(self, block: bool = True) -> np.ndarray | None:
        """A free buffer (uint8); None when ``block`` is off and none is free."""
        try:
            return self._free.get(block)
        except queue.Empty:
            return None

    def put(self, buf: np.ndarray) -> None:
        """Give ``buf`` (from :meth:`get`) back."""
        self._free.put(buf)

    @contextmanager
    def take(self) -> Iterator[np.ndarray]:
        """One free buffer, given back on exit."""
        buf = self._free.get()
        try:
            yield buf
        finally:
            self._free.put(buf)

    def close(self) -> None:
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view is still alive: the mapping goes with it
                pass
        self._maps = []


@dataclass(frozen=True)
class DiskCeiling:
    """Sequential throughput of a directory's disk with the state file's I/O (direct, ``depth`` requests in flight)."""

    directory: str
    nbytes: int
    chunk_bytes: int
    depth: int
    direct: bool
    write_gbps: float
    read_gbps: float
    mixed_gbps: float  # reads and writes at once, half each (what an update streaming its state does)


def measure_ceiling(directory: str, nbytes: int = 1 << 30, chunk_bytes: int = 8 << 20, depth: int = 4) -> DiskCeiling:
    """Write then read ``nbytes`` of an unnamed file in ``directory`` in ``chunk_bytes`` pieces, ``depth`` at a
    time, with the state file's I/O, then both at once (even pieces written, odd ones read); GB/s of each (writes
    timed to their data on the disk: ``fsync``)."""
    chunk_bytes = aligned_up(chunk_bytes)
    nbytes = aligned_up(max(nbytes, chunk_bytes))
    chunks = nbytes // chunk_bytes
    state = StateFile.create(directory, chunks * chunk_bytes, share=False)
    pool = AlignedPool(depth, chunk_bytes)
    try:
        rng = np.random.default_rng(0)
        for _ in range(depth):  # each buffer once (the pool hands them out in turn): incompressible data
            with pool.take() as buf:
                buf[:] = rng.integers(0, 256, buf.size, np.uint8)

        def write(i: int) -> None:
            with pool.take() as b:
                state.write_from(i * chunk_bytes, b)

        def read(i: int) -> None:
            with pool.take() as b:
                state.read_into(i * chunk_bytes, b)

        with ThreadPoolExecutor(depth, thread_name_prefix="slidedp-disk") as ex:
            t0 = time.perf_counter()
            list(ex.map(write, range(chunks)))
            os.fsync(state.fd)
            t1 = time.perf_counter()
            list(ex.map(read, range(chunks)))
            t2 = time.perf_counter()
            list(ex.map(lambda i: write(i) if i % 2 == 0 else read(i), range(chunks)))
            os.fsync(state.fd)
            t3 = time.perf_counter()
        total = chunks * chunk_bytes
        return DiskCeiling(directory, total, chunk_bytes, depth, state.direct, total / (t1 - t0) / 1e9,
                           total / (t2 - t1) / 1e9, total / (t3 - t2) / 1e9)  # fmt: skip
    finally:
        pool.close()
        state.close()


MADV_PAGEOUT = getattr(mmap, "MADV_PAGEOUT", 21)  # Linux >= 5.4 (Python's mmap names it where its headers did)
RECORD_ALIGN = 64  # bytes: each region inside a record starts on a cache line (a vector boundary for the kernels)
DISK_STATE = {"moments": MOMENTS, "master_and_moments": ("master", *MOMENTS)}  # what state_on_disk puts on disk


PIECE_BYTES = 64 << 20  # a record's most bytes: a unit's shard state is read and written in pieces of this size


@dataclass(frozen=True)
class Record:
    """One piece of one rank's shard of one unit in the state file: ``nbytes`` from ``offset`` (both page
    multiples), the unit-relative elements ``[start, start + elems)``, each region's range of them at
    ``parts[name] = (byte offset in the record, region elements)``."""

    offset: int
    nbytes: int
    parts: dict[str, tuple[int, int]]
    start: int = 0
    elems: int = 0


class DiskLayout:
    """Where the state file keeps each (unit, owner) shard's ranges of the regions on disk: contiguous,
    page-aligned records of at most ``piece_bytes`` each (a shard in one record when it fits), so the rank that
    updates a shard reads and writes its state in large direct-I/O requests, holds a bounded amount of it in
    memory at once however large a unit is, and no two ranks ever write the same page.

    ``regions``: the ledger regions kept on disk (see :data:`DISK_STATE`; the int8 moments bring their block scales
    along). A shard covers the unit-relative elements ``[r * n, (r + 1) * n)``, ``n = unit size / owners``, cut into
    pieces of whole QUANT_BLOCKs; a region that covers only a unit's trainable prefix
    (:meth:`LedgerGeometry.unit_elems`) has the piece's part of it."""

    def __init__(self, geometry: LedgerGeometry, regions: tuple[str, ...], piece_bytes: int = PIECE_BYTES) -> None:
        if geometry.optimizer_state == "int8" and any(m in regions for m in MOMENTS):
            regions = (*regions, "exp_avg_absmax", "exp_avg_sq_absmax")
        self.regions = tuple(r for r in geometry.specs if r in regions)
        self.geometry = geometry
        self.owners = geometry.world_size
        per_elem = sum(geometry.itemsize(r) / geometry.specs[r][1] for r in self.regions) or 1.0
        self.piece_elems = max(QUANT_BLOCK, int(piece_bytes / per_elem) // QUANT_BLOCK * QUANT_BLOCK)
        self.records: list[list[list[Record]]] = []  # [unit][owner][piece]
        pos = 0
        for u, size in enumerate(geometry.unit_sizes):
            n = size // self.owners
            row = []
            for r in range(self.owners):
                pieces = []
                for start in range(r * n, (r + 1) * n, self.piece_elems):
                    stop = min(start + self.piece_elems, (r + 1) * n)
                    parts, used = {}, 0
                    for name in self.regions:
                        covered = geometry.unit_elems(name, u)
                        elems = max(0, min(stop, covered) - start) // geometry.specs[name][1]
                        if elems:
                            parts[name] = (used, elems)
                            used = -(-(used + elems * geometry.itemsize(name)) // RECORD_ALIGN) * RECORD_ALIGN
                    nbytes = aligned_up(used)
                    pieces.append(Record(pos, nbytes, parts, start, stop - start))
                    pos += nbytes
                row.append(pieces)
            self.records.append(row)
        self.nbytes = pos

    def record(self, unit: int, owner: int, piece: int = 0) -> Record:
        return self.records[unit][owner][piece]

    def pieces(self, unit: int, owner: int) -> list[Record]:
        """The records of ``owner``'s shard of ``unit``, in element order."""
        return self.records[unit][owner]

    @property
    def max_record_bytes(self) -> int:
        return max((rec.nbytes for row in self.records for pieces in row for rec in pieces), default=0)

    def views(self, buf: np.ndarray, record: Record) -> dict[str, np.ndarray]:
        """The region arrays of ``record`` inside ``buf`` (a uint8 buffer holding that record from its byte 0)."""
        out = {}
        for name, (start, elems) in record.parts.items():
            dtype = np.dtype(str(self.geometry.dtype(name)).removeprefix("torch."))
            out[name] = buf[start : start + elems * dtype.itemsize].view(dtype)
        return out


Key = tuple[int, int]  # (unit, piece) of one owner's records


class RecordStream:
    """One rank's shard records of the state file, read ahead into an :class:`AlignedPool` and written back behind
    on ``threads`` I/O threads, so the update of one record overlaps the reads of the next and the writes of the last.

    Records are named by unit and piece (:meth:`DiskLayout.pieces`; a unit whose shard fits in one record has piece
    0 only). :meth:`prefetch` starts a record's read when a buffer is free (never blocks); :meth:`acquire` returns
    its region views (waiting for its read, or reading it now); :meth:`release` starts its write and gives the
    buffer back when that is done; :meth:`flush` waits for every write. A record is read only after its last write
    finished, so a record updated again reads what was written. An I/O error of a background read or write is raised
    by the next call."""

    def __init__(
        self,
        state: StateFile,
        layout: DiskLayout,
        owner: int,
        buffers: int = 4,
        threads: int = 2,
        on_io: Callable[[str, int, float, float, int], None] | None = None,
    ) -> None:
        """``on_io(op, unit, start, end, nbytes)``: called on the I/O thread after each read or write ("read", "write";
        ``time.perf_counter`` seconds), for lane traces."""
        if buffers < 2:
            raise ValueError(f"a record stream needs at least 2 buffers (one updated, one read ahead), got {buffers}")
        self.state, self.layout, self.owner = state, layout, owner
        self._pool = AlignedPool(buffers, max(layout.max_record_bytes, ALIGN))
        self._io = ThreadPoolExecutor(threads, thread_name_prefix=f"slidedp-state-r{owner}")
        self._reads: dict[Key, tuple[np.ndarray, Future[None]]] = {}  # record -> (buffer, its read)
        self._writes: dict[Key, Future[None]] = {}  # record -> its last write
        self._held: dict[Key, np.ndarray] = {}
        self.read_bytes = self.written_bytes = 0
        self._on_io = on_io

    def _timed(self, op: str, unit: int, nbytes: int, io: Callable[[], None]) -> None:
        start = time.perf_counter()
        io()
        if self._on_io is not None:
            self._on_io(op, unit, start, time.perf_counter(), nbytes)

    def _read(self, key: Key, buf: np.ndarray) -> Future[None]:
        rec = self.layout.record(key[0], self.owner, key[1])
        after = self._writes.get(key)

        def read() -> None:
            if after is not None:
                after.result()  # the record's last write first
            self._timed("read", key[0], rec.nbytes, lambda: self.state.read_into(rec.offset, buf[: rec.nbytes]))

        self.read_bytes += rec.nbytes
        return self._io.submit(read)

    def prefetch(self, unit: int, piece: int = 0) -> None:
        """Start reading a record if a buffer is free and it is not read or held already."""
        key = (unit, piece)
        if key in self._reads or key in self._held or not self.layout.record(unit, self.owner, piece).nbytes:
            return
        buf = self._pool.get(block=False)
        if buf is not None:
            self._reads[key] = (buf, self._read(key, buf))

    def acquire(self, unit: int, piece: int = 0) -> dict[str, np.ndarray]:
        """The region views of a record, read (each region a contiguous array of the record's range)."""
        key = (unit, piece)
        if key in self._held:
            raise RuntimeError(f"the state record of unit {unit}, piece {piece} is acquired already")
        if key not in self._reads:
            self._reads[key] = ((buf := self._take()), self._read(key, buf))
        buf, read = self._reads.pop(key)
        try:
            read.result()
        except BaseException:
            self._pool.put(buf)
            raise
        self._held[key] = buf
        return self.layout.views(buf, self.layout.record(unit, self.owner, piece))

    def _take(self) -> np.ndarray:
        """A free buffer; when none is free, the one of the oldest read ahead (a guess the update did not follow)."""
        buf = self._pool.get(block=False)
        if buf is not None:
            return buf
        if self._reads:
            key = next(iter(self._reads))
            buf, read = self._reads.pop(key)
            try:
                read.result()
            except OSError:
                pass  # that record is read again when acquired
            return buf
        buf = self._pool.get()  # every buffer is being written: the first write to end frees one
        assert buf is not None
        return buf

    def release(self, unit: int, piece: int = 0) -> None:
        """Write a record back (in the background); its buffer is free again once written."""
        key = (unit, piece)
        buf = self._held.pop(key)
        rec = self.layout.record(unit, self.owner, piece)
        previous = self._writes.get(key)

        def write() -> None:
            try:
                if previous is not None:
                    previous.result()
                self._timed("write", key[0], rec.nbytes, lambda: self.state.write_from(rec.offset, buf[: rec.nbytes]))
            finally:
                self._pool.put(buf)

        self.written_bytes += rec.nbytes
        self._writes[key] = self._io.submit(write)

    def when_written(self, unit: int, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the writes of ``unit``'s records released so far have ended: now when none is running,
        else on the I/O thread that ends the last. Never after a failed write (:meth:`check` raises its error)."""
        writes = [f for (u, _), f in self._writes.items() if u == unit]

        def call_if_written() -> None:
            if all(not f.cancelled() and f.exception() is None for f in writes):
                fn()

        running = [f for f in writes if not f.done()]
        if not running:
            call_if_written()
            return
        left, lock = [len(running)], threading.Lock()

        def ended(_: Future[None]) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                call_if_written()

        for f in running:
            f.add_done_callback(ended)

    def drop_reads(self) -> None:
        """Forget the records read ahead (their buffers free again): the file may be written through its mapping
        next (a checkpoint loaded, weights set), and a later acquire then reads what was written."""
        reads, self._reads = list(self._reads.values()), {}
        for buf, read in reads:
            try:
                read.result()
            except OSError:
                pass  # read again when acquired
            finally:
                self._pool.put(buf)

    def flush(self) -> None:
        """Wait for every write; raise the first I/O error."""
        writes, self._writes = list(self._writes.values()), {}
        for f in writes:
            f.result()

    def close(self) -> None:
        """Finish the writes (their errors are not raised here: :meth:`flush` raises them) and stop the threads."""
        self._io.shutdown(wait=True)
        self._reads.clear()
        self._held.clear()
        self._pool.close()

    def check(self) -> None:
        """Raise the first error of a write that has finished (never waits)."""
        for f in list(self._writes.values()):
            if f.done():
                f.result()


class DiskState:
    """The ledger regions one host keeps on a local disk (``LedgerGeometry.on_disk``): the state file, created by
    local rank 0 and opened by every local rank from its :attr:`handle` (as the ledger is), its
    :class:`DiskLayout`, and this process's :class:`RecordStream` of the shards it updates."""

    def __init__(self, state: StateFile, layout: DiskLayout) -> None:
        self.state = state
        self.layout = layout
        self.directory = state.directory
        self._stream: RecordStream | None = None
        self._map: mmap.mmap | None = None
        self.paging = False  # inside paged()
        self._closed = False

    @classmethod
    def create(cls, directory: str, geometry: LedgerGeometry, *, share: bool) -> DiskState:
        """A new state file for ``geometry``'s regions on disk in ``directory`` (refused with the numbers when the
        disk cannot hold it; see :meth:`StateFile.create`)."""
        layout = DiskLayout(geometry, geometry.on_disk, PIECE_BYTES)
        return cls(StateFile.create(directory, layout.nbytes, share=share), layout)

    @classmethod
    def open(cls, handle: LedgerHandle, directory: str, geometry: LedgerGeometry) -> DiskState:
        """The state file local rank 0 created, from its handle."""
        return cls(StateFile(LedgerFile.open(handle), directory), DiskLayout(geometry, geometry.on_disk, PIECE_BYTES))

    @property
    def handle(self) -> LedgerHandle:
        return self.state.file.handle()

    def stop_sharing(self) -> None:
        self.state.file.stop_sharing()

    def stream(
        self,
        owner: int,
        buffers: int = 4,
        threads: int = 2,
        on_io: Callable[[str, int, float, float, int], None] | None = None,
    ) -> RecordStream:
        """This process's record stream of ``owner``'s shards (one per process, made on first use)."""
        if self._stream is None:
            self._stream = RecordStream(self.state, self.layout, owner, buffers, threads, on_io)
        elif self._stream.owner != owner:
            raise RuntimeError(f"this process streams owner {self._stream.owner}'s records, not {owner}'s")
        return self._stream

    def clear(self, owner: int) -> None:
        """Write ``owner``'s records as zero moments: zero bytes are FP32 zeros and E4M3's zero, but the int8
        code of -1 in ``exp_avg``'s signed map, so int8 records get that map's code of 0 (blocks of scale 0)."""
        if "exp_avg_absmax" not in self.layout.regions:
            return  # FP32 moments: the reserved blocks read as zeros
        from cpu_ops.adamw8 import quantize_blockwise

        zero = int(quantize_blockwise(np.zeros(1, np.float32), signed=True)[0][0])
        stream = self.stream(owner)
        for unit in range(len(self.layout.records)):
            for piece, rec in enumerate(self.layout.pieces(unit, owner)):
                if rec.nbytes:
                    for name, view in stream.acquire(unit, piece).items():
                        if name != "master":  # (kept on disk too: its weights are written already)
                            view.fill(zero if name == "exp_avg" else 0)
                    stream.release(unit, piece)
        stream.flush()

    # -- whole-file access for checkpoints: the file mapped, while the update lane is idle and flushed ----------
    def part_views(self, region: str, unit: int) -> list[tuple[int, torch.Tensor]]:
        """``unit``'s range of ``region`` as it lies in the records: one ``(first element, view)`` per record (a
        piece of an owner's shard) holding part of it (elements of the region: a scale region counts blocks),
        views of the file mapped shared (reading them reads the disk through the page cache, writing them writes
        the file). Only while no record is read or written (after the update lane's flush); :meth:`unmap` when
        done."""
        geometry = self.layout.geometry
        dtype = geometry.dtype(region)
        per = geometry.specs[region][1]
        whole = self._mapped()
        out = []
        for owner in range(self.layout.owners):
            for rec in self.layout.pieces(unit, owner):
                if region in rec.parts:
                    start, elems = rec.parts[region]
                    lo = rec.offset + start
                    raw = whole[lo : lo + elems * geometry.itemsize(region)]
                    out.append((rec.start // per, raw.view(dtype)))
        return out

    def read_range(self, region: str, unit: int, start: int, out: torch.Tensor) -> None:
        """Copy ``unit``'s elements ``[start, start + out.numel())`` of ``region`` from the file into ``out``
        (through the mapping: :meth:`unmap` when done)."""
        self._copy_range(region, unit, start, out, into_file=False)

    def write_range(self, region: str, unit: int, start: int, values: torch.Tensor) -> None:
        """Write ``values`` at ``unit``'s element ``start`` of ``region`` into the file (through the mapping: its
        changes reach the file at :meth:`unmap`, which must come before the update lane reads the records again)."""
        self._copy_range(region, unit, start, values, into_file=True)

    def range_views(self, region: str, unit: int, start: int, stop: int) -> list[tuple[int, torch.Tensor]]:
        """``unit``'s elements ``[start, stop)`` of ``region`` as they lie in the records: ``(offset from start,
        view)`` per record holding some of them (views of the mapping, as :meth:`part_views`)."""
        out = []
        for first, view in self.part_views(region, unit):
            lo, hi = max(first, start), min(first + view.numel(), stop)
            if lo < hi:
                out.append((lo - start, view[lo - first : hi - first]))
        return out

    def _copy_range(self, region: str, unit: int, start: int, flat: torch.Tensor, into_file: bool) -> None:
        for at, view in self.range_views(region, unit, start, start + flat.numel()):
            if into_file:
                view.copy_(flat[at : at + view.numel()])
            else:
                flat[at : at + view.numel()].copy_(view)

    def _mapped(self) -> torch.Tensor:
        if self._map is None:
            self._map = mmap.mmap(self.state.fd, self.state.nbytes)
        return torch.frombuffer(self._map, dtype=torch.uint8)

    @contextmanager
    def paged(self, every_s: float = 0.05) -> Iterator[None]:
        """While a checkpoint reads or writes the mapped views: every ``every_s`` the mapping's changes are written
        to the file and its pages handed back (``MADV_PAGEOUT``), so the pages a checkpoint touched do not pile up
        in this process's memory (they would, up to the whole file, until the kernel needed the memory). Inside
        another ``paged()`` it adds nothing."""
        if self.paging:
            yield
            return
        stop = threading.Event()

        def page_out() -> None:
            while not stop.wait(every_s):
                self._page_out()

        pager = threading.Thread(target=page_out, name="slidedp-state-pager", daemon=True)
        pager.start()
        self.paging = True
        try:
            yield
        finally:
            self.paging = False
            stop.set()
            pager.join()
            self._page_out()

    def _page_out(self) -> None:
        m = self._map
        if m is None:
            return
        try:
            m.flush()
            m.madvise(MADV_PAGEOUT)
        except (OSError, ValueError):  # unmapped meanwhile, or a kernel without MADV_PAGEOUT (before 5.4)
            pass

    def unmap(self) -> None:
        """Write what the mapping changed to the file and let go of it (a view still alive keeps it mapped)."""
        if self._map is not None:
            self._map.flush()
            try:
                self._map.close()
            except BufferError:  # a caller still holds a view: it goes with the view
                pass
            self._map = None

    def close(self) -> None:
        """Let go of the mapping, the record stream and the file (once; a second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        self.unmap()
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self.state.close()
