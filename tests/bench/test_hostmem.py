"""The host-memory sampler's time windows (bench/baselines/hostmem.py)."""

from __future__ import annotations

import os

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
