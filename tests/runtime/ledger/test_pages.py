"""ledger_pages: a new ledger's pages allocated and mapped in bulk, exactly the spans asked for, contents kept."""

from __future__ import annotations

import os

import pytest
import torch

from slidedp_lightning.runtime.ledger import pages as ledger_pages
from slidedp_lightning.runtime.ledger.geometry import LedgerGeometry
from slidedp_lightning.runtime.ledger.host_ledger import HostLedger
from slidedp_lightning.runtime.ledger.pages import PAGE, ledger_spans, lock_ranges, prepare_pages
from slidedp_lightning.runtime.ledger.preflight import HostMemoryError

N = 1 << 20  # elements: 4 MiB of FP32 master


def _ledger(tmp_path) -> HostLedger:
    geometry = LedgerGeometry(total=N, num_units=2, world_size=1, staging_slots=0, staging_elems=0, staging_itemsize=4)
    return HostLedger(str(tmp_path), geometry, create=True)


def _views(ledger: HostLedger, lo: int, n: int) -> list[torch.Tensor]:
    """The FP32 master and BF16 copy of the elements ``[lo, lo + n)``: what a fill writes."""
    return [ledger.master[lo : lo + n], ledger.bf16[lo : lo + n]]


def _resident(ledger: HostLedger, name: str, lo: int, hi: int, size: int) -> list[bool]:
    """Per page of ``name``'s elements [lo, hi): whether the file holds it (SEEK_DATA/SEEK_HOLE)."""
    fd = ledger.file.fd  # the unnamed file's own descriptor (only its offset moves)
    start = ledger.geometry.offsets[name]
    out = []
    for page in range(start + lo * size, start + hi * size, PAGE):
        try:
            out.append(os.lseek(fd, page, os.SEEK_DATA) == page)
        except OSError:  # no data after it
            out.append(False)
    return out


def test_the_pieces_pages_are_allocated_whole_pages_only_and_their_contents_kept(tmp_path) -> None:
    ledger = _ledger(tmp_path)
    try:
        assert ledger.allocated_bytes() < PAGE * 4  # a new file holds (almost) nothing
        ledger.master[10] = 3.5  # written before: kept
        lo, n = 10, 300_000  # starts and ends inside a page
        assert prepare_pages(ledger, ledger_spans(ledger, _views(ledger, lo, n)), threads=2)
        master = _resident(ledger, "master", 0, N, 4)
        per_page = PAGE // 4
        first, last = -(-lo // per_page), (lo + n) // per_page  # the pages wholly inside
        assert all(master[first:last]) and not any(master[last + 1 :])
        bf16 = _resident(ledger, "bf16", 0, N, 2)
        assert all(bf16[-(-lo * 2 // PAGE) : (lo + n) * 2 // PAGE]) and not any(bf16[(lo + n) * 2 // PAGE + 1 :])
        assert not any(_resident(ledger, "exp_avg", 0, N, 4))  # the moments are left to their writes
        assert ledger.master[10].item() == 3.5 and not ledger.master[11:].any() and not ledger.bf16.any()
    finally:
        ledger.close()


def test_the_pages_are_allocated_and_a_full_host_says_so(tmp_path, monkeypatch) -> None:
    ledger = _ledger(tmp_path)
    try:
        before = ledger.allocated_bytes()
        assert prepare_pages(ledger, ledger_spans(ledger, _views(ledger, 0, N)), threads=1)
        assert ledger.allocated_bytes() - before >= 6 * N - 2 * PAGE  # fallocate + MADV_POPULATE_WRITE
        assert torch.count_nonzero(ledger.master) == 0
    finally:
        ledger.close()
    ledger = _ledger(tmp_path)
    try:

        class Full:
            def fallocate(self, *args: object) -> int:
                return -1

            def madvise(self, *args: object) -> int:
                return 0

        monkeypatch.setattr(ledger_pages, "_libc", lambda: Full())
        monkeypatch.setattr(ledger_pages.ctypes, "get_errno", lambda: 28)  # ENOSPC
        with pytest.raises(HostMemoryError, match=r"could not allocate 6\.00 MiB of ledger pages .*ENOSPC"):
            prepare_pages(ledger, ledger_spans(ledger, _views(ledger, 0, N)), threads=1)
        monkeypatch.setattr(ledger_pages.ctypes, "get_errno", lambda: 95)  # EOPNOTSUPP: populate alone
        assert prepare_pages(ledger, ledger_spans(ledger, _views(ledger, 0, N)), threads=1)
    finally:
        ledger.close()


def test_lock_ranges_widen_to_pages_merge_and_refuse_outside_views() -> None:
    g = LedgerGeometry(total=4 * 2048, num_units=4, world_size=1, staging_slots=0, staging_elems=0, staging_itemsize=4)
    led = HostLedger(None, g, create=True)
    try:
        base = led.master.data_ptr() - led.mapping_address()
        assert base % PAGE == 0
        # two pieces of the master inside one page and the next: one range, whole pages
        assert lock_ranges(led, [led.master[1:10], led.master[1000:1100]]) == [(base, base + 2 * PAGE)]
        # pieces pages apart stay apart; an empty view adds nothing; order does not matter
        far = led.master[4 * 1024 : 4 * 1024 + 1]
        assert lock_ranges(led, [far, led.master[:0], led.master[:1]]) == [
            (base, base + PAGE),
            (base + 4 * PAGE, base + 5 * PAGE),
        ]
        with pytest.raises(ValueError, match="not inside"):
            lock_ranges(led, [torch.zeros(4)])
    finally:
        led.close()
