"""A private tmpfs for a test's ledgers, and its used bytes: a measure of leaked shared memory that other jobs
running on the same machine (with their own ledgers in /dev/shm) cannot disturb."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator

import pytest


def used_bytes(directory: str) -> int:
    """Bytes in use on the filesystem of ``directory`` (statvfs)."""
    st = os.statvfs(directory)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@contextlib.contextmanager
def private_tmpfs(size: str = "512m") -> Iterator[str]:
    """A fresh tmpfs mounted for the length of the block (root only: the test is skipped elsewhere)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a private tmpfs needs root")
    directory = tempfile.mkdtemp(prefix="slidedp-shm-")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "none", directory], capture_output=True)
    if mounted.returncode != 0:
        os.rmdir(directory)
        pytest.skip(f"cannot mount a private tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", directory], check=False)
        os.rmdir(directory)
