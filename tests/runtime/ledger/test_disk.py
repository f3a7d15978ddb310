"""The state file on a local disk: unnamed, reserved, direct I/O, shared, and refusals that name the numbers."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest
import torch

from slidedp_lightning.runtime.ledger import disk
from slidedp_lightning.runtime.ledger.disk import (
    ALIGN,
    DISK_STATE,
    AlignedPool,
    DiskLayout,
    DiskStateError,
    RecordStream,
    StateFile,
    measure_ceiling,
)
from slidedp_lightning.runtime.ledger.geometry import LedgerGeometry
from slidedp_lightning.runtime.ledger.memory import LedgerFile

MIB = 1 << 20


def test_written_bytes_read_back_from_an_unnamed_reserved_file(tmp_path) -> None:
    state = StateFile.create(str(tmp_path), 3 * MIB + 5, share=False)
    try:
        assert state.nbytes == 3 * MIB + ALIGN  # rounded up to the alignment
        assert os.listdir(tmp_path) == [] and os.fstat(state.fd).st_nlink == 0  # never has a name
        assert os.fstat(state.fd).st_blocks * 512 >= state.nbytes  # every block reserved up front
        pool = AlignedPool(2, MIB)
        with pool.take() as out, pool.take() as back:
            assert out.ctypes.data % ALIGN == 0 and back.ctypes.data % ALIGN == 0
            out[:] = np.random.default_rng(1).integers(0, 256, out.size, np.uint8)
            state.write_from(2 * MIB, out)
            state.read_into(2 * MIB, back)
            np.testing.assert_array_equal(back, out)
            state.read_into(0, back)
            assert not back.any()  # reserved, never written: zeros
        pool.close()
    finally:
        state.close()


def test_another_process_view_reads_what_one_wrote(tmp_path) -> None:
    """Local rank 0 creates and shares the file; a rank that opens it by the handle sees the same bytes."""
    creator = StateFile.create(str(tmp_path), MIB, share=True)
    other = StateFile(LedgerFile.open(creator.file.handle()), str(tmp_path))
    try:
        pool = AlignedPool(1, MIB)
        with pool.take() as buf:
            buf[:] = 7
            creator.write_from(0, buf)
            buf[:] = 0
            other.read_into(0, buf)
            assert (buf == 7).all()
        pool.close()
    finally:
        other.close()
        creator.close()


def test_a_disk_too_small_is_refused_with_the_numbers_before_any_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(disk, "free_bytes", lambda directory: 10 * MIB)
    with pytest.raises(DiskStateError, match=r"has 10\.00 MiB free, the state file needs 64\.00 MiB: free 54\.00 MiB"):
        StateFile.create(str(tmp_path), 64 * MIB, share=False)
    assert os.listdir(tmp_path) == []


def test_a_missing_directory_or_one_without_unnamed_files_is_refused(tmp_path, monkeypatch) -> None:
    with pytest.raises(DiskStateError, match="does not exist"):
        StateFile.create(str(tmp_path / "nowhere"), MIB, share=False)

    def no_tmpfile(*args, **kwargs):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(LedgerFile, "create", no_tmpfile)
    with pytest.raises(DiskStateError, match="cannot hold unnamed files .* local ext4, xfs or btrfs"):
        StateFile.create(str(tmp_path), MIB, share=False)


def test_an_io_error_names_the_directory_the_operation_and_the_place(tmp_path) -> None:
    state = StateFile.create(str(tmp_path), MIB, share=False)
    pool = AlignedPool(1, ALIGN)
    read_only = os.open(state.file.path, os.O_RDONLY)
    writable, state.fd = state.fd, read_only
    try:
        with (
            pool.take() as buf,
            pytest.raises(
                DiskStateError, match=rf"in {tmp_path}: write of 4.00 KiB at byte 8192 failed: Bad file descriptor"
            ),
        ):
            state.write_from(2 * ALIGN, buf)
    finally:
        state.fd = writable
        os.close(read_only)
        pool.close()
        state.close()


def test_direct_io_refuses_unaligned_pieces_and_any_outside_the_file(tmp_path) -> None:
    state = StateFile.create(str(tmp_path), MIB, share=False)
    try:
        pool = AlignedPool(1, 2 * ALIGN)
        with pool.take() as b:
            with pytest.raises(ValueError, match="outside the state file"):
                state.read_into(MIB - ALIGN, b)
            if state.direct:
                with pytest.raises(ValueError, match="aligned to 4096 bytes: offset 512"):
                    state.read_into(512, b)
        pool.close()
    finally:
        state.close()


def test_the_pool_blocks_when_every_buffer_is_taken() -> None:
    pool = AlignedPool(1, 100)
    assert pool.nbytes == ALIGN
    taken = threading.Event()

    def second() -> None:
        with pool.take():
            taken.set()

    with pool.take():
        t = threading.Thread(target=second)
        t.start()
        assert not taken.wait(0.2)  # the second take waits for the first buffer
    assert taken.wait(5)
    t.join()
    with pytest.raises(ValueError, match="at least one buffer"):
        AlignedPool(0, 1)


def test_the_disk_ceiling_is_measured_in_both_directions(tmp_path) -> None:
    ceiling = measure_ceiling(str(tmp_path), nbytes=8 * MIB, chunk_bytes=MIB, depth=2)
    assert ceiling.nbytes == 8 * MIB and ceiling.write_gbps > 0 and ceiling.read_gbps > 0 and ceiling.mixed_gbps > 0
    assert os.listdir(tmp_path) == []  # the measuring file is gone


def _geometry(optimizer_state: str, trainable_sizes: tuple[int, ...] = (), regions_of_unit=()) -> LedgerGeometry:
    sizes = (4096, 8192, 2048)
    return LedgerGeometry(
        total=sum(sizes), num_units=3, world_size=2, staging_slots=0, staging_elems=0, staging_itemsize=4,
        unit_sizes=sizes, optimizer_state=optimizer_state, trainable_sizes=trainable_sizes,
        regions_of_unit=regions_of_unit,
    )  # fmt: skip


@pytest.mark.parametrize("state", ["fp32", "int8"])
@pytest.mark.parametrize("on_disk", ["moments", "master_and_moments"])
def test_each_shard_is_one_page_aligned_record_and_the_records_cover_the_regions(state: str, on_disk: str) -> None:
    geometry = _geometry(state, trainable_sizes=(4096, 6144, 0), regions_of_unit=(
        ("master", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax", "bf16"),) * 2 + (("bf16",),))  # fmt: skip
    layout = DiskLayout(geometry, DISK_STATE[on_disk])
    expected = {"master": on_disk == "master_and_moments", "exp_avg_absmax": state == "int8"}
    assert ("master" in layout.regions) == expected["master"]
    assert ("exp_avg_absmax" in layout.regions) == expected["exp_avg_absmax"]
    pos = 0
    for u in range(3):
        for r in range(2):
            rec = layout.record(u, r)
            assert rec.offset == pos and rec.offset % ALIGN == 0 and rec.nbytes % ALIGN == 0
            pos += rec.nbytes
        for name in layout.regions:
            covered = sum(layout.record(u, r).parts.get(name, (0, 0))[1] for r in range(2))
            assert covered == geometry.unit_elems(name, u) // geometry.specs[name][1], (u, name)
    assert layout.nbytes == pos
    assert layout.record(2, 0).parts == {} and layout.record(2, 0).nbytes == 0  # a frozen unit has no state
    # unit 1 keeps moments over its first 6144 of 8192 elements: owner 1's shard [4096, 8192) has 2048 of them
    assert layout.record(1, 1).parts["exp_avg"][1] == 2048


def test_the_views_of_a_record_are_its_regions_without_overlap() -> None:
    geometry = _geometry("int8")
    layout = DiskLayout(geometry, DISK_STATE["master_and_moments"])
    rec = layout.record(1, 1)
    pool = AlignedPool(1, layout.max_record_bytes)
    with pool.take() as buf:
        views = layout.views(buf, rec)
        assert {k: v.dtype.name for k, v in views.items()} == {
            "master": "float32", "exp_avg": "uint8", "exp_avg_sq": "uint8", "exp_avg_absmax": "float32",
            "exp_avg_sq_absmax": "float32",
        }  # fmt: skip
        assert views["master"].size == 4096 and views["exp_avg_absmax"].size == 4
        for i, v in enumerate(views.values()):
            v[:] = i + 1
            assert v.ctypes.data % 64 == 0
        for i, v in enumerate(views.values()):
            assert (v == i + 1).all()
    pool.close()


def _stream_setup(tmp_path, state: str = "fp32", buffers: int = 3):
    geometry = _geometry(state)
    layout = DiskLayout(geometry, DISK_STATE["master_and_moments"])
    file = StateFile.create(str(tmp_path), layout.nbytes, share=False)
    return layout, file, RecordStream(file, layout, owner=0, buffers=buffers)


def test_records_written_back_are_read_again_and_the_other_owners_are_untouched(tmp_path) -> None:
    layout, file, stream = _stream_setup(tmp_path)
    try:
        for u in range(3):
            for i, view in enumerate(stream.acquire(u).values()):
                view[:] = 10 * u + i + 1
            stream.release(u)
        stream.flush()
        again = RecordStream(file, layout, owner=0)
        for u in range(3):
            for i, view in enumerate(again.acquire(u).values()):
                assert (view == 10 * u + i + 1).all(), (u, i)
            again.release(u)
        again.close()
        other = RecordStream(file, layout, owner=1)
        assert all(not v.any() for v in other.acquire(1).values())  # owner 1's shard of unit 1: never written
        other.close()
    finally:
        stream.close()
        file.close()


def test_a_record_is_read_only_after_its_last_write(tmp_path, monkeypatch) -> None:
    """Updated twice in a row: the second read waits for the first write (made slow here), never reading stale."""
    import time

    layout, file, stream = _stream_setup(tmp_path)
    write = file.write_from

    def slow_write(offset, buf):
        time.sleep(0.2)
        write(offset, buf)

    monkeypatch.setattr(file, "write_from", slow_write)
    try:
        for step in range(1, 4):
            stream.prefetch(0)  # a read ahead issued while the last write is still under way
            master = stream.acquire(0)["master"]
            assert (master == step - 1).all(), step
            master += 1
            stream.release(0)
        stream.flush()
    finally:
        stream.close()
        file.close()


def test_when_written_waits_for_the_units_writes_and_never_follows_a_failed_one(tmp_path, monkeypatch) -> None:
    """The callback of a unit's writes: at once with none running, after the slow write of its record (not before,
    whatever other units write), and never when that write failed."""
    import threading
    import time

    layout, file, stream = _stream_setup(tmp_path)
    write, gate = file.write_from, threading.Event()

    def gated_write(offset, buf):
        if offset == layout.record(1, 0).offset:
            gate.wait(10)
            if not gate.is_set() or failing:
                raise DiskStateError(errno.EIO, "write failed")
        write(offset, buf)

    monkeypatch.setattr(file, "write_from", gated_write)
    failing, called = False, []
    try:
        stream.when_written(0, lambda: called.append("unit 0, nothing written"))
        assert called == ["unit 0, nothing written"]
        for u in (1, 2):
            stream.acquire(u)
            stream.release(u)
        stream.when_written(1, lambda: called.append("unit 1"))
        stream.when_written(2, lambda: called.append("unit 2"))

        def until(what: str) -> bool:
            deadline = time.monotonic() + 10
            while what not in called and time.monotonic() < deadline:
                time.sleep(0.01)
            return what in called

        assert until("unit 2") and called[1:] == ["unit 2"]  # unit 1's write is still held
        gate.set()
        stream.flush()  # (a future's callbacks run just after its waiters wake)
        assert until("unit 1") and called[1:] == ["unit 2", "unit 1"]
        gate.clear()
        failing = True
        stream.acquire(1)
        stream.release(1)
        stream.when_written(1, lambda: called.append("unit 1 again"))
        gate.set()
        with pytest.raises(DiskStateError):
            stream.flush()
        time.sleep(0.1)
        assert "unit 1 again" not in called
    finally:
        stream.close()
        file.close()


def test_reads_ahead_are_used_once_and_never_block_and_a_missed_guess_frees_its_buffer(tmp_path) -> None:
    layout, file, stream = _stream_setup(tmp_path, buffers=2)
    try:
        for u in (0, 1, 2):
            stream.prefetch(u)  # the third finds no free buffer and is skipped, without waiting
        assert stream.read_bytes == layout.record(0, 0).nbytes + layout.record(1, 0).nbytes
        stream.acquire(2)  # not read ahead: takes the buffer of the oldest guess (unit 0)
        stream.acquire(1)  # read ahead: not read again
        assert stream.read_bytes == sum(layout.record(u, 0).nbytes for u in (0, 1, 2))
        stream.release(2)
        stream.release(1)
        stream.flush()
    finally:
        stream.close()
        file.close()


def test_a_failed_background_write_is_raised_by_the_next_flush(tmp_path, monkeypatch) -> None:
    layout, file, stream = _stream_setup(tmp_path, buffers=2)

    def fail(offset, buf):
        raise DiskStateError(errno.EIO, f"SlideDP state file in {tmp_path}: write failed: Input/output error")

    try:
        stream.acquire(0)
        monkeypatch.setattr(file, "write_from", fail)
        stream.release(0)
        with pytest.raises(DiskStateError, match="write failed"):
            stream.flush()
        stream.acquire(1)  # the failed write's buffer is back in the pool
        stream.acquire(0)
    finally:
        stream.close()
        file.close()


@pytest.mark.parametrize("state", ["fp32", "int8"])
def test_updates_through_the_records_equal_updates_in_memory_bit_for_bit(tmp_path, state: str) -> None:
    """Three AdamW steps of each unit shard with its master and moments streamed from the file equal the same
    kernels on arrays in memory."""
    from cpu_ops import adamw8_update, adamw_update

    layout, file, stream = _stream_setup(tmp_path, state)
    rng = np.random.default_rng(0)
    memory = {}
    try:
        for u in range(3):  # the same start in the file and in memory
            views = stream.acquire(u)
            views["master"][:] = rng.standard_normal(views["master"].size, dtype=np.float32)
            memory[u] = {k: v.copy() for k, v in views.items()}
            stream.release(u)
        for step in range(1, 4):
            for u in range(3):
                stream.prefetch((u + 1) % 3)
                views = stream.acquire(u)
                grad = rng.standard_normal(views["master"].size, dtype=np.float32)
                for arrays in (views, memory[u]):
                    if state == "fp32":
                        adamw_update(arrays["master"], arrays["exp_avg"], arrays["exp_avg_sq"], grad, step=step,
                                     lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)  # fmt: skip
                    else:
                        adamw8_update(arrays["master"], arrays["exp_avg"], arrays["exp_avg_sq"],
                                      arrays["exp_avg_absmax"], arrays["exp_avg_sq_absmax"], grad,
                                      segments=np.array([[0, grad.size, 0]], np.int64),
                                      hyper=[(1e-2, 0.9, 0.999, 1e-8, 0.01, True)], step=step)  # fmt: skip
                stream.release(u)
        stream.flush()
        for u in range(3):
            views = stream.acquire(u)
            for name, array in memory[u].items():
                np.testing.assert_array_equal(views[name], array, err_msg=f"unit {u} {name}")
            stream.release(u)
    finally:
        stream.close()
        file.close()


def _rss_file() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile:"))


def test_mapped_views_hand_their_pages_back_and_write_the_file(tmp_path) -> None:
    """A checkpoint's pass over the mapped state file: what it wrote is in the file (read back by direct I/O), and
    the pages it touched are not left in this process's memory."""
    n = 64 << 20  # 64 Mi elements: 256 MiB a moment
    g = LedgerGeometry(total=n, num_units=1, world_size=2, staging_slots=0, staging_elems=0, staging_itemsize=4,
                       unit_sizes=(n,), on_disk=("exp_avg", "exp_avg_sq"))  # fmt: skip
    state = disk.DiskState.create(str(tmp_path), g, share=False)
    try:
        before = _rss_file()
        with state.paged(every_s=0.05):
            for region in ("exp_avg", "exp_avg_sq"):
                parts = state.part_views(region, 0)
                firsts = [first for first, _ in parts]  # records of at most 64 MiB: 8 a shard, back to back
                assert len(parts) == 2 * 256 // 64 and firsts == sorted(firsts) and firsts[len(parts) // 2] == n // 2
                assert all(a + v.numel() == b for (a, v), b in zip(parts, [*firsts[1:], n]))
                for first, view in parts:
                    view.copy_(torch.arange(first, first + view.numel(), dtype=torch.float32))
                del parts, view
        grown = _rss_file() - before
        assert grown < 64 << 20, f"{grown >> 20} MiB of the 512 MiB touched are still mapped in"
        state.unmap()
        stream = state.stream(owner=1)
        for piece, rec in enumerate(state.layout.pieces(0, 1)):
            got = stream.acquire(0, piece)["exp_avg_sq"]
            assert torch.equal(torch.from_numpy(got.copy()), torch.arange(rec.start, rec.start + rec.elems).float())
            stream.release(0, piece)
        stream.flush()
    finally:
        state.close()
