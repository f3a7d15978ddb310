"""The job's peak host memory: the process tree of the launching process, and its summed PSS, sampled."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from slidedp_lightning.recipes.host_memory import PeakHostMemory, process_tree, pss_bytes


def test_the_tree_holds_the_children_and_their_memory_counts():
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(64 << 20); time.sleep(30)"])
    try:
        for _ in range(200):  # until the child holds its 64 MiB
            if pss_bytes(child.pid) > 64 << 20:
                break
            subprocess.run(["sleep", "0.05"], check=True)
        assert child.pid in process_tree(os.getpid())
        assert pss_bytes(child.pid) > 64 << 20 and pss_bytes(os.getpid()) > 0
        peak = PeakHostMemory(launching=True, interval_s=0.01)
        peak.setup(None, None, "fit")  # type: ignore[arg-type]
        subprocess.run(["sleep", "0.2"], check=True)
        peak.stop()
        assert peak.peak_bytes is not None and peak.peak_bytes > pss_bytes(child.pid) and peak.processes >= 2
    finally:
        child.kill()
        child.wait()
    assert pss_bytes(child.pid) == 0  # gone: nothing to count
    other = PeakHostMemory(launching=False)
    other.setup(None, None, "fit")  # type: ignore[arg-type]
    other.stop()
    assert other.peak_bytes is None  # only the launching process samples


def test_the_sampler_takes_at_most_its_share_of_a_core():
    cheap = PeakHostMemory(launching=True, interval_s=0.5, max_share=1.0)
    costly = PeakHostMemory(launching=True, interval_s=0.5, max_share=1e-4)
    for peak in (cheap, costly):
        peak.setup(None, None, "fit")  # type: ignore[arg-type]
    subprocess.run(["sleep", "0.3"], check=True)
    for peak in (cheap, costly):
        peak.stop()
    # a sample costs milliseconds: the first keeps its interval, the other waits 10^4 times the sample's CPU time
    assert cheap.longest_wait_s == 0.5 and cheap.peak_bytes
    assert costly.longest_wait_s > 5 and costly.peak_bytes


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5])
def test_a_share_outside_one_core_is_refused(share):
    with pytest.raises(ValueError, match="max_share"):
        PeakHostMemory(launching=True, max_share=share)
