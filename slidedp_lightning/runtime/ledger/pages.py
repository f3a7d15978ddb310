"""The pages of a new ledger, allocated and mapped before its weights are written.

A new ledger file holds no memory: every 4 KiB page is allocated, zeroed and mapped at its first write, one page
fault each, and the fill of a checkpoint (FP32 master + BF16 copy, 6 bytes per parameter) is bound by those
faults. Asking the kernel for the pages in bulk first costs less per page than faulting them in from user space
(measured in docs/PERFORMANCE.md, "Loading a pretrained checkpoint"): ``fallocate`` allocates the file's pages,
``madvise(MADV_POPULATE_WRITE)`` (Linux >= 5.14) maps them writable into this process, both a 64 MiB chunk at a
time on several threads. Either step is skipped where the file system or the kernel does not offer it (the writes
then fault the pages in as before); contents are never changed, so ranks may prepare neighbouring ranges at the
same time.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from slidedp_lightning.runtime.host_os import format_bytes
from slidedp_lightning.runtime.ledger.host_ledger import HostLedger
from slidedp_lightning.runtime.ledger.preflight import HostMemoryError, shm_dir

__all__ = ["ledger_spans", "lock_ranges", "prepare_pages"]

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h (Linux 5.14)
CHUNK = 64 << 20
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# not offered here, or interrupted: the writes fault in whatever is left
_UNSUPPORTED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS, errno.EPERM, errno.EINTR, errno.EAGAIN)


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        return libc
    except (OSError, AttributeError):
        return None


def _inward(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte spans ``[a, b)`` merged where they touch and shrunk to whole pages inside them (a page only partly
    inside is left to its writes: it may belong to ranges this process does not write)."""
    merged: list[list[int]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if merged and a - merged[-1][1] < PAGE:  # a gap inside one page: no page lies wholly in it
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    out: list[tuple[int, int]] = []
    for a, b in merged:
        a, b = -(-a // PAGE) * PAGE, b // PAGE * PAGE
        out.extend((s, min(s + CHUNK, b)) for s in range(a, b, CHUNK))
    return out


def ledger_spans(ledger: HostLedger, views: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """Byte spans ``[a, b)`` of the ledger's mapping that the 1-D ``views`` of it (region ranges) cover."""
    base = ledger.mapping_address()
    return [(v.data_ptr() - base, v.data_ptr() - base + v.numel() * v.element_size()) for v in views if v.numel()]


def lock_ranges(ledger: HostLedger, views: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """Byte ranges ``[a, b)`` of the ledger's mapping to page-lock for device copies of the 1-D ``views``: their
    spans widened to whole pages (a page partly covered is locked whole) and merged where they touch."""
    size = ledger.geometry.nbytes
    merged: list[list[int]] = []
    for a, b in sorted(ledger_spans(ledger, views)):
        if a < 0 or b > size:
            raise ValueError(f"a view of {b - a} bytes at offset {a} is not inside this {size}-byte ledger")
        a, b = a // PAGE * PAGE, -(-b // PAGE) * PAGE
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def prepare_pages(ledger: HostLedger, spans: list[tuple[int, int]], threads: int) -> bool:
    """Allocate and map the pages of the ledger's file byte ``spans`` (see the module's docstring) on ``threads``
    threads; False where the kernel cannot map them in bulk (the writes then fault them in). Raises
    :class:`HostMemoryError` when there is no room for them."""
    libc = _libc()
    chunks = _inward(spans)
    if libc is None or not chunks:
        return False
    base = ledger.mapping_address()
    fd = ledger.file.fd  # the ledger's own descriptor (the file has no name to open)

    def allocate(chunk: tuple[int, int]) -> int:
        a, b = chunk
        return 0 if fd is None or libc.fallocate(fd, 0, a, b - a) == 0 else ctypes.get_errno()

    def populate(chunk: tuple[int, int]) -> int:
        a, b = chunk
        return 0 if libc.madvise(base + a, b - a, MADV_POPULATE_WRITE) == 0 else ctypes.get_errno()

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="slidedp-pages") as pool:
        for step in (allocate, populate):
            codes = set(pool.map(step, chunks)) - {0}
            if codes - set(_UNSUPPORTED):
                need = sum(b - a for a, b in chunks)
                raise HostMemoryError(
                    f"SlideDP could not allocate {format_bytes(need)} of ledger pages in {shm_dir()} "
                    f"({', '.join(errno.errorcode.get(c, str(c)) for c in sorted(codes))}): the host is out of "
                    "shared memory. Free host memory or enlarge the shared-memory file system, then start again."
                )
            if codes:
                log.debug("SlideDP: %s of the ledger pages not offered here (%s)", step.__name__, sorted(codes))
                if step is populate:
                    return False
    return True
