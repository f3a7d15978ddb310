"""runtime.ledger.memory: the ledger's unnamed file, created by one process and opened by others."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

from slidedp_lightning.runtime.ledger import memory as ledger_file
from slidedp_lightning.runtime.ledger.memory import LedgerFile, LedgerHandle
from tests.shm_usage import private_tmpfs, used_bytes

MiB = 1 << 20
MODULE = ledger_file.__file__


def test_an_unnamed_file_is_shared_by_its_handle_and_never_appears_in_the_directory(tmp_path) -> None:
    a = LedgerFile.create(str(tmp_path), MiB, "t", share=True)
    assert a.kind == f"O_TMPFILE in {tmp_path}"
    assert os.listdir(tmp_path) == []
    handle = a.handle()
    assert handle.pid == os.getpid() and handle.socket is not None and handle.nbytes == MiB
    b = LedgerFile.open(handle)
    assert b.kind.startswith("opened through /proc/")
    os.pwrite(a.fd, b"ledger", 100)
    assert os.pread(b.fd, 6, 100) == b"ledger"
    assert os.fstat(b.fd).st_nlink == 0 and os.fstat(b.fd).st_size == MiB
    assert os.listdir(tmp_path) == []
    a.close()
    assert os.pread(b.fd, 6, 100) == b"ledger", "the file lives as long as any process holds it"
    b.close()
    assert b.fd is None and os.listdir(tmp_path) == []


def test_a_filesystem_without_o_tmpfile_gets_a_memfd_and_says_so(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="slidedp_lightning.runtime.ledger.memory"):
        f = LedgerFile.create("/sys", MiB, "slidedp-ledger", share=False)  # sysfs: EOPNOTSUPP
    try:
        assert f.kind == "memfd" and f.handle().socket is None
        assert "/sys does not support unnamed files" in caplog.text and "memfd" in caplog.text
        assert os.readlink(f"/proc/self/fd/{f.fd}").startswith("/memfd:slidedp-ledger")
        g = LedgerFile.open(f.handle())
        os.pwrite(f.fd, b"x", 0)
        assert os.pread(g.fd, 1, 0) == b"x"
        g.close()
    finally:
        f.close()


def test_a_handle_of_a_gone_creator_is_refused_naming_it(tmp_path) -> None:
    a = LedgerFile.create(str(tmp_path), MiB, "t", share=False)
    h = a.handle()
    a.close()
    with pytest.raises(FileNotFoundError, match=f"/proc/{h.pid}/fd/{h.fd}"):
        LedgerFile.open(h)
    dead = LedgerHandle(2**22 + 7, 5, h.dev, h.ino, MiB, "slidedp-ledger-none")  # no such pid, no such socket
    with pytest.raises(FileNotFoundError, match="Local rank 0 has probably died"):
        LedgerFile.open(dead)


LOAD = """
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("ledger_file", sys.argv[-1])  # stdlib only: no package import
ledger_file = importlib.util.module_from_spec(spec)
sys.modules["ledger_file"] = ledger_file
spec.loader.exec_module(ledger_file)
LedgerFile, LedgerHandle = ledger_file.LedgerFile, ledger_file.LedgerHandle
"""
CREATOR = (
    LOAD
    + """
import ctypes
os.setgid(65534); os.setuid(65534)  # a user process; losing root also makes it non-dumpable
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0, as ptrace-restricted hosts leave a process
f = LedgerFile.create(sys.argv[1], 1 << 20, "t", share=True)
os.pwrite(f.fd, b"from the creator", 0)
h = f.handle()
print(h.pid, h.fd, h.dev, h.ino, h.nbytes, h.socket, flush=True)
sys.stdin.readline()
f.close()
"""
)
OPENER = (
    LOAD
    + """
os.setgid(int(sys.argv[1])); os.setuid(int(sys.argv[1]))
pid, fd, dev, ino, nbytes, sock = sys.argv[2:8]
try:
    os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
    print("proc: allowed")
except OSError as err:
    print("proc:", err.strerror)
try:
    g = LedgerFile.open(LedgerHandle(int(pid), int(fd), int(dev), int(ino), int(nbytes), sock))
    print("kind:", g.kind)
    print("read:", os.pread(g.fd, 16, 0).decode())
except OSError as err:
    print("error:", err)
"""
)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users (to get a non-dumpable creator) needs root")
def test_a_creator_that_proc_refuses_hands_the_descriptor_over_its_socket_to_its_own_user_only() -> None:
    import shutil
    import tempfile

    # reachable by another user; not named slidedp-*, which the tests that look for files left in /dev/shm watch,
    # perhaps in another pytest-xdist worker at this moment
    tmp_path = tempfile.mkdtemp(prefix="ledger-test-", dir="/dev/shm")
    os.chmod(tmp_path, 0o777)
    env = dict(os.environ)
    creator = subprocess.Popen(
        [sys.executable, "-c", CREATOR, tmp_path, MODULE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert creator.stdout is not None and creator.stdin is not None
        fields = creator.stdout.readline().split()
        assert len(fields) == 6, fields

        def opener(uid: int) -> str:
            return subprocess.run(
                [sys.executable, "-c", OPENER, str(uid), *fields, MODULE],
                capture_output=True,
                text=True,
                env=env,
                timeout=60,
            ).stdout

        same = opener(65534)
        assert "proc: Permission denied" in same, same  # the ptrace rule: /proc/<pid>/fd of a non-dumpable process
        assert "kind: received over a Unix socket (SCM_RIGHTS)" in same and "read: from the creator" in same, same
        other = opener(65533)
        assert "proc: Permission denied" in other and "error:" in other and "read:" not in other, other
        assert os.listdir(tmp_path) == []
        creator.stdin.write("\n")
        creator.stdin.flush()
        assert creator.wait(timeout=30) == 0
    finally:
        creator.kill()
        shutil.rmtree(tmp_path)


def test_the_memory_is_freed_when_the_last_holder_closes() -> None:
    with private_tmpfs() as directory:
        base = used_bytes(directory)
        a = LedgerFile.create(directory, 8 * MiB, "t", share=True)
        b = LedgerFile.open(a.handle())
        os.pwrite(a.fd, b"\1" * (4 * MiB), 0)
        assert used_bytes(directory) - base >= 4 * MiB, "the file's pages count against its directory's tmpfs"
        a.close()
        assert used_bytes(directory) - base >= 4 * MiB
        b.close()
        assert used_bytes(directory) == base


SCRIPT = LOAD + textwrap.dedent(
    """
    f = LedgerFile.create(sys.argv[1], 8 << 20, "t", share=False)
    os.pwrite(f.fd, b"\\1" * (4 << 20), 0)
    print("written", flush=True)
    sys.stdin.readline()
    """
)


def test_a_killed_creator_leaves_nothing() -> None:
    with private_tmpfs() as directory:
        base = used_bytes(directory)
        proc = subprocess.Popen(
            [sys.executable, "-c", SCRIPT, directory, MODULE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "written"
        assert used_bytes(directory) - base >= 4 * MiB
        proc.kill()
        proc.wait(timeout=30)
        assert used_bytes(directory) == base and os.listdir(directory) == []


@pytest.mark.parametrize("huge", [None, "within_size"])
def test_the_log_says_whether_the_ledger_gets_huge_pages(caplog, huge: str | None) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a private tmpfs needs root")
    directory = tempfile.mkdtemp(prefix="slidedp-huge-")
    options = "size=64m" + (f",huge={huge}" if huge else "")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "none", directory], capture_output=True).returncode:
        os.rmdir(directory)
        pytest.skip("cannot mount a private tmpfs")
    try:
        with caplog.at_level(logging.INFO, logger=ledger_file.__name__):
            file = LedgerFile.create(directory, 4 << 20, "slidedp-test", share=False)
        try:
            policy = ledger_file.huge_page_policy(file.fd)  # type: ignore[arg-type]
        finally:
            file.close()
        host = open(ledger_file.SHMEM_ENABLED).read() if os.path.exists(ledger_file.SHMEM_ENABLED) else ""
        if "[force]" in host or "[deny]" in host:
            pytest.skip(f"the host's shmem_enabled decides: {host.strip()}")
        assert policy == (huge or "never")
        said = " ".join(r.getMessage() for r in caplog.records)
        assert ("huge pages (within_size)" if huge else "4 KiB pages (huge=never)") in said, said
        assert "SLIDEDP_SHM_DIR" not in said, "a small ledger gets no advice"
        assert "SLIDEDP_SHM_DIR" in ledger_file.pages_note("never", ledger_file.HINT_BYTES)
    finally:
        subprocess.run(["umount", "-l", directory], check=False)
        os.rmdir(directory)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that starts at ``address`` (/proc/self/smaps)."""
    start = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start = int(head.split("-")[0], 16)
            elif head == "VmFlags:" and start == address:
                return line.split()[1:]
    raise AssertionError(f"no mapping starts at {address:#x}")


def test_private_memory_is_zero_filled_advised_huge_and_kept_out_of_forks(caplog) -> None:
    with caplog.at_level(logging.INFO, logger=ledger_file.__name__):
        memory = ledger_file.PrivateLedgerMemory(8 * MiB)
    try:
        assert memory.fd is None and memory.memory is not None
        assert memory.allocated_bytes() == 0, "nothing is allocated before it is written"
        view = memoryview(memory.memory)
        assert bytes(view[: 1 << 16]) == bytes(1 << 16)
        view[3 * MiB : 5 * MiB] = b"\x01" * (2 * MiB)
        assert 2 * MiB <= memory.allocated_bytes() <= 6 * MiB  # whole pages, huge ones where the host gives them
        flags = _vm_flags(memory._address)
        assert "dc" in flags, "MADV_DONTFORK: a forked child gets no copy-on-write claim on it"
        if memory.huge:
            assert "hg" in flags, "MADV_HUGEPAGE"
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "private memory of this process" in said and "pages" in said, said
        with pytest.raises(RuntimeError, match="no handle"):
            memory.handle()
        del view
    finally:
        memory.close()
    assert memory.memory is None
