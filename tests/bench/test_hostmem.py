"""The host-memory sampler's time windows and its share of a core (bench/baselines/hostmem.py)."""

from __future__ import annotations

import os
import time

import pytest

from bench.baselines.hostmem import Sample, Sampler, sample


def test_sample_spans_its_reading() -> None:
    s = sample(os.getpid())
    assert s.procs >= 1 and s.pss > 0
    assert s.wall <= s.wall_end


def test_peak_counts_only_samples_read_inside_the_window() -> None:
    sampler = Sampler(os.getpid())
    sampler.samples = [
        Sample(9.9, 900, 0, 0, 1, 10.2),  # began before the window: read partly outside it
        Sample(10.3, 500, 0, 0, 1, 10.4),
        Sample(10.5, 600, 0, 0, 1, 10.6),
        Sample(10.9, 800, 0, 0, 1, 11.1),  # ended after the window
    ]
    assert sampler.peak(10.0, 11.0).pss == 600
    assert sampler.peak().pss == 900
    assert sampler.peak(12.0, 13.0) is None


def test_the_sampler_takes_at_most_its_share_of_a_core() -> None:
    cheap, costly = Sampler(os.getpid(), 0.2, max_share=1.0), Sampler(os.getpid(), 0.2, max_share=1e-4)
    for s in (cheap, costly):
        s.start()
    time.sleep(0.5)
    for s in (cheap, costly):
        s.stop()
    # a sample costs milliseconds: the first keeps its interval, the other waits 10^4 times the sample's CPU time
    assert cheap.longest_wait_s == 0.2 and len(cheap.samples) >= 2
    assert costly.longest_wait_s > 5 and len(costly.samples) == 1


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5])
def test_a_share_outside_one_core_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="max_share"):
        Sampler(os.getpid(), max_share=share)
