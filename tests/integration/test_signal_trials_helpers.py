"""The trials' process follower: a killed job counts as ended only once its memory is released."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.integration.signal_trials import session_pids
from tests.shm_usage import private_tmpfs, used_bytes

# maps and touches a tmpfs file, unlinks it, starts threads: a SIGKILL makes the main thread a zombie while the
# other threads still run their exit, and the last of them unmaps the file
HOLDER = r"""
import mmap, os, sys, threading, time
path, size = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_RDWR | os.O_CREAT)
os.ftruncate(fd, size)
m = mmap.mmap(fd, size)
os.unlink(path)
for i in range(0, size, 4096):
    m[i] = 1
for _ in range(8):
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.slow  # a subprocess of its own: out of the fast tier
def test_a_killed_process_is_followed_until_its_shared_pages_are_released() -> None:
    with private_tmpfs("1g") as shm:
        empty = used_bytes(shm)
        for _ in range(10):  # a zombie main thread with pages still held: about 4 kills in 10 here
            proc = subprocess.Popen(
                [sys.executable, "-c", HOLDER, os.path.join(shm, "held"), str(256 << 20)],
                stdout=subprocess.PIPE,
                start_new_session=True,
            )
            try:
                assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
                assert used_bytes(shm) - empty >= 256 << 20
                os.kill(proc.pid, signal.SIGKILL)
                while session_pids(proc.pid):
                    pass
                assert used_bytes(shm) == empty, "the follower saw the job end while its pages were still mapped"
            finally:
                proc.kill()
                proc.wait()
