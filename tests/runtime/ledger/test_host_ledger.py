"""runtime.ledger.host_ledger: ledger geometry, the shared-memory ledger file and the host memory check."""

from __future__ import annotations

import os

import pytest
import torch

from slidedp_lightning.constants import LEDGER_BYTES_PER_PARAM
from slidedp_lightning.runtime.ledger.geometry import GUARD, PAGE, LedgerGeometry
from slidedp_lightning.runtime.ledger.host_ledger import HostLedger
from slidedp_lightning.runtime.ledger.preflight import HostMemoryError, check_host_memory, shm_dir

ARRAYS = ("stamps", "master", "exp_avg", "exp_avg_sq", "bf16", "staging")


def page(n: int) -> int:
    return -(-n // PAGE) * PAGE


def array_bytes(g: LedgerGeometry) -> dict[str, int]:
    r, u, k = g.world_size, g.num_units, g.staging_slots
    return {
        "stamps": 8 * (u * r + r + r * k + r * r * k + 8),
        "master": 4 * g.total,
        "exp_avg": 4 * g.total,
        "exp_avg_sq": 4 * g.total,
        "bf16": 2 * g.total,
        "staging": r * k * g.staging_elems * g.staging_itemsize,
    }


GEOMETRIES = [
    LedgerGeometry(total=4 * 2048, num_units=4, world_size=1, staging_slots=0, staging_elems=0, staging_itemsize=4),
    LedgerGeometry(total=6 * 2048, num_units=3, world_size=2, staging_slots=2, staging_elems=4096, staging_itemsize=4),
    LedgerGeometry(total=3 * 3072, num_units=5, world_size=3, staging_slots=3, staging_elems=3072, staging_itemsize=2),
    LedgerGeometry(total=1024, num_units=1, world_size=1, staging_slots=1, staging_elems=1024, staging_itemsize=2),
]


@pytest.mark.parametrize("g", GEOMETRIES, ids=lambda g: f"T{g.total}-R{g.world_size}-K{g.staging_slots}")
def test_geometry_bytes_and_offsets(g: LedgerGeometry) -> None:
    sizes = array_bytes(g)
    off = g.offsets
    assert list(off) == [*ARRAYS, "end"]
    assert sum(sizes[a] for a in ("master", "exp_avg", "exp_avg_sq", "bf16")) == LEDGER_BYTES_PER_PARAM * g.total
    assert g.staging_bytes == sizes["staging"]
    pos = 0
    for name in ARRAYS:
        assert off[name] % PAGE == 0, name
        assert off[name] == pos, f"{name} starts right after the previous array's pages and guard"
        if sizes[name]:
            pos = page(pos + sizes[name]) + GUARD
    assert off["end"] == pos == g.nbytes
    # no overlap, and a guard of at least a page between consecutive non-empty arrays
    spans = [(off[a], off[a] + sizes[a]) for a in ARRAYS if sizes[a]]
    for (_, end0), (start1, _) in zip(spans, spans[1:]):
        assert start1 - end0 >= GUARD
    assert spans[-1][1] <= g.nbytes
    # 14 B/param of the padded total plus the stamps, staging, page rounding and one guard per array
    n_arrays = len(spans)
    overhead = g.nbytes - LEDGER_BYTES_PER_PARAM * g.total - sizes["stamps"] - sizes["staging"]
    assert 0 <= overhead < n_arrays * (GUARD + PAGE)


def entries(directory: str) -> set[str]:
    return set(os.listdir(directory))


def test_create_open_and_share_without_a_name() -> None:
    g = LedgerGeometry(total=2048, num_units=2, world_size=2, staging_slots=2, staging_elems=1024, staging_itemsize=4)
    directory = shm_dir()
    before = entries(directory)
    a = HostLedger(directory, g, create=True, share=True)
    assert entries(directory) - before == set(), "the ledger must never have a name in its directory"
    assert os.fstat(a.file.fd).st_nlink == 0 and os.fstat(a.file.fd).st_size == g.nbytes
    b = HostLedger(a.handle, g, create=False)
    assert entries(directory) - before == set()
    assert os.fstat(b.file.fd).st_ino == os.fstat(a.file.fd).st_ino
    for led in (a, b):
        assert led.master.dtype == torch.float32 and led.master.numel() == g.total
        assert led.exp_avg.numel() == led.exp_avg_sq.numel() == g.total
        assert led.bf16.dtype == torch.bfloat16 and led.bf16.numel() == g.total
        assert led.staging is not None and tuple(led.staging.shape) == (2, 2, 1024)
        assert led.version.shape == (2, 2) and led.pids.shape == (2,)
        assert led.grad_gen.shape == (2, 2) and led.consumed.shape == (2, 2, 2)
    assert a.owner and not b.owner

    # a fresh file is zero
    assert not a.master.any() and not a.exp_avg_sq.any() and not a.version.any()

    a.master[5] = 3.0
    b.exp_avg[-1] = -2.0
    a.bf16[7] = 1.5
    a.version[1, 0] = 7
    b.consumed[1, 0, 1] = 9
    b.staging[1, 0, 3] = 4.0
    assert b.master[5].item() == 3.0
    assert a.exp_avg[-1].item() == -2.0
    assert b.bf16[7].item() == 1.5
    assert b.version[1, 0] == 7
    assert a.consumed[1, 0, 1] == 9
    assert a.staging[1, 0, 3].item() == 4.0
    # the arrays are distinct regions of the file
    assert a.exp_avg[5].item() == 0.0 and a.exp_avg_sq[5].item() == 0.0 and a.master[-1].item() == 0.0

    # the numpy views the kernels use are the same memory
    master, _, _, bf16 = b.np_arrays()
    master[6] = 11.0
    assert a.master[6].item() == 11.0
    assert bf16.dtype.name == "uint16" and bf16[7] == a.bf16[7:8].view(torch.int16).item()

    a.stop_sharing()
    a.stop_sharing()  # idempotent
    # both mappings still work after the creator stopped sharing it
    a.exp_avg_sq[10] = 5.0
    b.master[11] = 6.0
    assert b.exp_avg_sq[10].item() == 5.0
    assert a.master[11].item() == 6.0
    assert a.allocated_bytes() > 0
    a.close()
    b.close()
    assert a.master is None and b.master is None
    assert entries(directory) - before == set()


def test_no_staging_for_gpu_reduce() -> None:
    g = LedgerGeometry(total=1024, num_units=1, world_size=1, staging_slots=0, staging_elems=0, staging_itemsize=4)
    led = HostLedger(shm_dir(), g, create=True)
    try:
        assert led.staging is None
        assert g.staging_bytes == 0
    finally:
        led.close()


def test_check_host_memory_absurd_size_raises() -> None:
    g = LedgerGeometry(total=10**13, num_units=4, world_size=1, staging_slots=0, staging_elems=0, staging_itemsize=4)
    with pytest.raises(HostMemoryError) as info:
        check_host_memory(g, num_params=10**13)
    msg = str(info.value)
    assert f"{g.nbytes / (1 << 30):.2f} GiB" in msg
    assert "10,000,000,000,000 params" in msg
    assert shm_dir() in msg
    assert isinstance(info.value, MemoryError)


def test_check_host_memory_mentions_staging() -> None:
    g = LedgerGeometry(
        total=10**12, num_units=4, world_size=2, staging_slots=2, staging_elems=10**11, staging_itemsize=4
    )
    with pytest.raises(HostMemoryError, match="host_reduce staging") as info:
        check_host_memory(g, num_params=10**12)
    assert f"{g.staging_bytes / (1 << 30):.2f} GiB host_reduce staging" in str(info.value)


def test_check_host_memory_small_passes() -> None:
    g = LedgerGeometry(total=4096, num_units=2, world_size=1, staging_slots=2, staging_elems=2048, staging_itemsize=4)
    check_host_memory(g, num_params=4000)


def test_a_private_ledger_is_process_memory_unless_a_directory_is_named(monkeypatch, tmp_path) -> None:
    from slidedp_lightning.runtime.ledger.memory import PrivateLedgerMemory
    from slidedp_lightning.runtime.ledger.preflight import SHM_ENV, ledger_directory

    monkeypatch.delenv(SHM_ENV, raising=False)
    assert ledger_directory(shared=False) is None and ledger_directory(shared=True) == "/dev/shm"
    g = LedgerGeometry(total=4096, num_units=2, world_size=1, staging_slots=0, staging_elems=0, staging_itemsize=4)
    led = HostLedger(None, g, create=True)
    try:
        assert isinstance(led.file, PrivateLedgerMemory)
        assert not led.master.any() and not led.exp_avg_sq.any() and not led.bf16.any()
        led.master[7] = 2.5
        assert led.master[7].item() == 2.5 and led.allocated_bytes() > 0
        with pytest.raises(AssertionError, match="cannot be shared"):
            HostLedger(None, g, create=True, share=True)
    finally:
        led.close()
    assert led.master is None
    monkeypatch.setenv(SHM_ENV, str(tmp_path))
    assert ledger_directory(shared=False) == ledger_directory(shared=True) == str(tmp_path)


def test_a_private_ledger_needs_host_memory_not_room_in_the_shm_directory(monkeypatch) -> None:
    from slidedp_lightning.runtime.ledger import preflight

    g = LedgerGeometry(total=1 << 20, num_units=2, world_size=1, staging_slots=0, staging_elems=0, staging_itemsize=4)

    class Full:
        f_bavail, f_frsize = 0, 4096

    monkeypatch.setattr(preflight.os, "statvfs", lambda path: Full())
    check_host_memory(g, 1 << 20, directory=None)  # its own memory: the full /dev/shm does not matter
    monkeypatch.setattr(preflight, "available_host_bytes", lambda directory="": (4096, 4096))
    with pytest.raises(HostMemoryError, match=r"of host memory .*\(MemAvailable 4\.00 KiB\)\. Free host memory\.$"):
        check_host_memory(g, 1 << 20, directory=None)  # no advice about /dev/shm, which it does not use
    monkeypatch.undo()
    monkeypatch.setattr(preflight.os, "statvfs", lambda path: Full())
    with pytest.raises(HostMemoryError, match="/dev/shm free 0 B"):
        check_host_memory(g, 1 << 20)


def test_a_ledger_closed_while_device_copies_may_run_stays_mapped_until_exit(monkeypatch) -> None:
    """After an error the engine cannot always wait for its device copies; a page-locked ledger closed then is
    neither unpinned nor unmapped (a late DMA must land in pages that are still this ledger's)."""
    from slidedp_lightning.runtime.ledger import host_ledger

    def no_cuda():
        raise AssertionError("unpinned while copies may still run")

    g = LedgerGeometry(total=2048, num_units=1, world_size=1, staging_slots=0, staging_elems=0, staging_itemsize=4)
    led = HostLedger(None, g, create=True)
    raw = led._raw
    led._pinned_at = [raw.data_ptr()]  # as pin() leaves it on CUDA
    monkeypatch.setattr(torch.cuda, "cudart", no_cuda)
    held = len(host_ledger._HELD_UNTIL_EXIT)
    try:
        led.close(copies_done=False)
        assert led._raw is None and led._pinned_at == []
        assert host_ledger._HELD_UNTIL_EXIT[-1] is raw and len(host_ledger._HELD_UNTIL_EXIT) == held + 1
        raw[:8].fill_(1)  # still mapped
    finally:
        del host_ledger._HELD_UNTIL_EXIT[held:]
    unpinned = HostLedger(None, g, create=True)
    unpinned.close(copies_done=False)  # nothing page-locked: nothing to hold
    assert len(host_ledger._HELD_UNTIL_EXIT) == held
