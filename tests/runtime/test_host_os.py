"""The process tree a memory sampler sums: every process below the root, whichever thread started it."""

from __future__ import annotations

import os
import signal
import subprocess
import threading

from slidedp_lightning.runtime.host_os import process_children, process_tree


def test_the_tree_holds_children_a_thread_other_than_the_main_one_started():
    started, done = threading.Event(), threading.Event()
    procs: list[subprocess.Popen] = []

    def launch() -> None:  # as a launcher or a data loader thread starts processes
        procs.append(subprocess.Popen(["sh", "-c", "sleep 30 & wait"]))
        started.set()
        done.wait(30)

    thread = threading.Thread(target=launch)
    thread.start()
    grandchild: list[int] = []
    try:
        assert started.wait(10)
        child = procs[0].pid
        for _ in range(200):  # until the shell has started its sleep
            grandchild = process_children(child)
            if grandchild:
                break
            threading.Event().wait(0.02)
        assert child not in process_children(os.getpid())  # not the main thread's child
        tree = process_tree(os.getpid())
        assert tree[0] == os.getpid() and child in tree and grandchild and grandchild[0] in tree
    finally:
        for pid in grandchild:
            os.kill(pid, signal.SIGKILL)
        for p in procs:
            p.kill()
            p.wait()
        done.set()
        thread.join()
