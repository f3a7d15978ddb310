"""The ledger's memory: a file shared by the ranks of a host without ever having a name, or, for a ledger that only
its own process maps, that process's private memory (:class:`PrivateLedgerMemory`).

Local rank 0 creates an unnamed file: ``O_TMPFILE | O_EXCL`` in the ledger directory (``$SLIDEDP_SHM_DIR`` or
/dev/shm, so its pages count against that filesystem's size, and it can never be linked to a name), or, where the
directory's filesystem does not support ``O_TMPFILE``, a memfd. The other local ranks open the same file through
``/proc/<creator pid>/fd/<fd>``; where that is refused (a creator that is not dumpable, /proc mounted with
``hidepid``, a security module), the creator hands the descriptor over a Unix socket in the abstract namespace
(``SCM_RIGHTS``), which has no name in any filesystem either, and only to processes of its own user.

The memory lives exactly as long as some process holds the file open or mapped: a rank that dies at any moment,
before or after the others opened it, leaves nothing behind.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import socket
import struct
import threading
import uuid
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

# errors of open(O_TMPFILE) that mean "this filesystem cannot", not "this directory is wrong"
NO_TMPFILE = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOTSUP)
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class LedgerHandle:
    """What another rank of the host needs to open the creator's ledger file (picklable, sent in a collective)."""

    pid: int  # the creating process
    fd: int  # its descriptor of the file
    dev: int  # (st_dev, st_ino): the file's identity, checked by the opener
    ino: int
    nbytes: int
    socket: str | None  # abstract Unix socket name (without the leading NUL) handing the descriptor over


class LedgerFile:
    """An open descriptor of an unnamed ledger file: :meth:`create` (local rank 0) or :meth:`open` (the others)."""

    def __init__(self, fd: int, kind: str, nbytes: int) -> None:
        self.fd: int | None = fd
        self.kind = kind  # "O_TMPFILE in <dir>", "memfd", or how another rank obtained it
        self.nbytes = nbytes
        self._server: socket.socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def path(self) -> str:
        """A path that opens this file from this process (for mapping it)."""
        assert self.fd is not None, "the ledger file is closed"
        return f"/proc/self/fd/{self.fd}"

    @classmethod
    def create(cls, directory: str, nbytes: int, label: str, *, share: bool, memfd_fallback: bool = True) -> LedgerFile:
        """A new zero-filled unnamed file of ``nbytes`` bytes in ``directory`` (a memfd where the filesystem does not
        support ``O_TMPFILE``, unless ``memfd_fallback`` is off: then the ``OSError``); ``share``: serve its
        descriptor to the other ranks until :meth:`stop_sharing`."""
        try:
            fd = os.open(directory, os.O_TMPFILE | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
            kind = f"O_TMPFILE in {directory}"
        except OSError as err:
            if err.errno not in NO_TMPFILE or not memfd_fallback:
                raise
            fd = os.memfd_create(label[:200] or "slidedp-ledger", os.MFD_CLOEXEC)
            kind = "memfd"
            log.warning(
                "SlideDP: %s does not support unnamed files (O_TMPFILE: %s); the ledger is a memfd instead, whose "
                "pages count against the kernel's internal shared memory, not against %s",
                directory,
                err.strerror,
                directory,
            )
        try:
            os.ftruncate(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        file = cls(fd, kind, nbytes)
        if share:
            file._serve()
        if memfd_fallback:  # a memory file: its page size matters
            log.info(
                "SlideDP ledger file: an unnamed %s of %d bytes, never linked to a name; %s",
                kind,
                nbytes,
                pages_note(huge_page_policy(fd), nbytes),
            )
        return file

    def handle(self) -> LedgerHandle:
        assert self.fd is not None, "the ledger file is closed"
        st = os.fstat(self.fd)
        name = self._server.getsockname()[1:].decode() if self._server is not None else None
        return LedgerHandle(os.getpid(), self.fd, st.st_dev, st.st_ino, self.nbytes, name)

    @classmethod
    def open(cls, handle: LedgerHandle) -> LedgerFile:
        """The creator's file, through /proc or else over its socket; an error names the creator when neither works
        (it has died, or the host's rules allow neither)."""
        via_proc = f"/proc/{handle.pid}/fd/{handle.fd}"
        try:
            fd = os.open(via_proc, os.O_RDWR | os.O_CLOEXEC)
        except OSError as err:
            reason = f"{via_proc}: {err.strerror}"
        else:
            if _identity(fd) == (handle.dev, handle.ino):
                return cls(fd, f"opened through {via_proc}", handle.nbytes)
            os.close(fd)
            reason = f"{via_proc} is another file (the creator is gone and its pid reused)"
        if handle.socket is None:
            raise FileNotFoundError(errno.ENOENT, f"SlideDP cannot open local rank 0's ledger file: {reason}")
        try:
            fd = _receive(handle)
        except OSError as err:
            raise FileNotFoundError(
                errno.ENOENT,
                f"SlideDP cannot open local rank 0's ledger file (pid {handle.pid}): {reason}, and its socket "
                f"refused too ({err}). Local rank 0 has probably died; see its output.",
            ) from err
        log.debug("SlideDP: %s; received the ledger descriptor over a Unix socket instead", reason)
        return cls(fd, "received over a Unix socket (SCM_RIGHTS)", handle.nbytes)

    # -- the descriptor server (creator only) --------------------------------------------------------------------
    def _serve(self) -> None:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        server.bind(f"\0slidedp-ledger-{os.getpid()}-{uuid.uuid4().hex}")
        server.listen(64)
        server.settimeout(0.1)
        self._server = server
        self._thread = threading.Thread(target=self._answer, name="slidedp-ledger-fd", daemon=True)
        self._thread.start()

    def _answer(self) -> None:
        server, fd = self._server, self.fd
        assert server is not None and fd is not None
        while not self._stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                try:
                    _, uid, _ = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
                    if uid != os.getuid():
                        log.warning("SlideDP: refused the ledger descriptor to a process of uid %d", uid)
                        continue
                    socket.send_fds(conn, [b"L"], [fd])
                except OSError as err:
                    log.debug("SlideDP: handing the ledger descriptor over failed: %s", err)

    def stop_sharing(self) -> None:
        """Stop serving the descriptor (every rank has the file now)."""
        if self._server is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._server.close()
        self._server, self._thread = None, None

    def allocated_bytes(self) -> int:
        """Bytes of memory the file holds now (a page is allocated when first written)."""
        assert self.fd is not None, "the ledger file is closed"
        return os.fstat(self.fd).st_blocks * 512

    def close(self) -> None:
        """Stop sharing and close this process's descriptor (its mapping, if any, stays valid until unmapped)."""
        self.stop_sharing()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _receive(handle: LedgerHandle) -> int:
    """The descriptor from the creator's socket, checked to come from the creator and to be its file."""
    assert handle.socket is not None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as conn:
        conn.settimeout(30)
        conn.connect(f"\0{handle.socket}")
        pid, _, _ = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        if pid != handle.pid:
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"the socket belongs to pid {pid}, not {handle.pid}")
        _, fds, _, _ = socket.recv_fds(conn, 1, 1, socket.MSG_CMSG_CLOEXEC)
    if not fds:
        raise ConnectionResetError(errno.ECONNRESET, "the creator closed the socket without a descriptor")
    for extra in fds[1:]:
        os.close(extra)
    if _identity(fds[0]) != (handle.dev, handle.ino):
        os.close(fds[0])
        raise ConnectionRefusedError(errno.ECONNREFUSED, "the descriptor received is not the ledger file")
    return fds[0]


class PrivateLedgerMemory:
    """A ledger that no other process maps (one local rank, or one ledger per rank): anonymous private memory of
    this process, zero-filled, with transparent huge pages asked for (``MADV_HUGEPAGE``), which the host's THP
    setting for process memory grants (``enabled`` = ``always`` or ``madvise``, the common defaults) where the
    shared-memory file systems mostly do not (``shmem_enabled`` = ``never``, /dev/shm without ``huge=``): 512x fewer
    page faults to fill it (docs/PERFORMANCE.md, loading a pretrained checkpoint). ``MADV_DONTFORK`` keeps it out
    of forked children (data-loader workers), whose copy-on-write claim on its pages would otherwise copy every page
    that the next update writes. The memory lives exactly as long as the process, or until the last view of it is
    dropped after :meth:`close`."""

    def __init__(self, nbytes: int) -> None:
        self.fd: int | None = None  # no file: nothing to allocate, open or hand over
        self.nbytes = nbytes
        self.memory: mmap.mmap | None = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advised = []
        for name in ("MADV_HUGEPAGE", "MADV_DONTFORK"):
            try:
                self.memory.madvise(getattr(mmap, name))
                advised.append(name)
            except (AttributeError, OSError) as err:  # an old kernel, or THP compiled out
                log.debug("SlideDP: %s refused for the private ledger: %s", name, err)
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(self.memory))
        self.kind = "private memory of this process"
        self.huge = "MADV_HUGEPAGE" in advised
        log.info("SlideDP ledger: %d bytes of %s; %s", nbytes, self.kind, private_pages_note(self.huge))

    def handle(self) -> LedgerHandle:
        raise RuntimeError("a private ledger is mapped by its own process only: it has no handle to share")

    def stop_sharing(self) -> None:
        """Nothing to stop: a private ledger is never shared."""

    def allocated_bytes(self) -> int:
        """Bytes of memory the ledger holds now (a page is allocated when first written), by ``mincore``."""
        assert self.memory is not None, "the private ledger is closed"
        page = mmap.PAGESIZE
        pages = -(-self.nbytes // page)
        resident = np.zeros(max(pages, 1), np.uint8)  # one byte per page, bit 0: resident
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        if libc.mincore(self._address, pages * page, resident.ctypes.data_as(ctypes.c_void_p)) != 0:
            raise OSError(ctypes.get_errno(), "mincore of the private ledger failed")
        return int(np.count_nonzero(resident & 1)) * page

    def close(self) -> None:
        """Drop this object's reference: the memory goes back once no tensor views it either (a mapping with views
        cannot be unmapped by hand)."""
        self.memory = None


THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def _selected(setting: str) -> str | None:
    """The selected word of a sysfs choice such as ``always [madvise] never``; None where it cannot be read."""
    try:
        with open(setting) as f:
            return next((w.strip("[]") for w in f.read().split() if w.startswith("[")), None)
    except OSError:
        return None


def private_pages_note(advised: bool) -> str:
    """The log's words on a private ledger's pages: the host's THP setting for process memory."""
    policy = _selected(THP_ENABLED)
    if policy == "always" or (policy == "madvise" and advised):
        return f"transparent huge pages (enabled={policy})"
    return "page size unknown" if policy is None else f"4 KiB pages (transparent huge pages: enabled={policy})"


SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def huge_page_policy(fd: int) -> str | None:
    """The transparent-huge-page policy of the shared-memory file ``fd``: its tmpfs mount's ``huge=`` option
    (``never`` when absent), or for a memfd the host's ``shmem_enabled``; the host's ``force`` or ``deny`` wins over
    either. None where the file is not on tmpfs or the kernel does not say."""
    host = _selected(SHMEM_ENABLED)
    if host in ("force", "deny"):
        return host
    st = os.fstat(fd)
    device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    try:
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    for fields in mounts:
        if fields[2] != device or "-" not in fields:
            continue
        fstype, options = fields[fields.index("-") + 1], fields[-1].split(",")
        if fstype != "tmpfs":
            return None
        return next((o.split("=", 1)[1] for o in options if o.startswith("huge=")), "never")
    return host  # not among this process's mounts: the kernel's internal one (a memfd)


HINT_BYTES = 1 << 30  # from this ledger size on, the log says how to get huge pages


def pages_note(policy: str | None, nbytes: int) -> str:
    """The log's words on the ledger's pages: with 4 KiB pages the fill of a large ledger is bound by page faults."""
    if policy in ("always", "within_size", "force"):
        return f"huge pages ({policy})"
    if policy is None:
        return "page size unknown"
    note = f"4 KiB pages (huge={policy})"
    if nbytes >= HINT_BYTES:
        note += (
            ": a tmpfs mounted with huge=within_size, named by SLIDEDP_SHM_DIR, fills a large ledger faster "
            "(docs/PERFORMANCE.md, loading a pretrained checkpoint)"
        )
    return note
