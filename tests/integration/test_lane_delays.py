"""Random delays in every lane change nothing, bit for bit: every consumer waits for its producer."""

from __future__ import annotations

import pytest
import torch

from tests.integration.conftest import BATCH, STEPS, variant_result, variants_job
from tests.integration.equivalence_cases import MATRIX, _case_knobs, case_result, differing, matrix_result, run_matrix

pytestmark = pytest.mark.slow  # multi-process jobs

DELAYS = {"SLIDEDP_TEST_LANE_DELAY_MS": "1"}


CASES = [
    "tied-sharded-host_reduce-window3",
    "untied-gpu_reduce",
    "tied-window1",
    "untied-sharded-chunk4KiB-window2",
    "untied-host_reduce-chunk4KiB",
]


@pytest.mark.integration
@pytest.mark.parametrize("case", CASES)
def test_random_lane_delays_leave_results_bit_identical(job_runner, case, trace_dir):
    calm = case_result(job_runner, case, trace_dir)  # the equivalence suite's run of the case
    variants = {c: _case_knobs(c, trace_dir) for c in CASES}  # every case delayed, a fit each in one job
    common = dict(strategy="slidedp", devices=2, tied=True, steps=STEPS, batch=BATCH)
    job = variants_job(job_runner, "slidedp_cases_delayed", variants, env=DELAYS, **common)
    delayed = variant_result(job, case)
    assert calm.returncode == 0, calm.output[-3000:]
    assert delayed.returncode == 0, delayed.output[-3000:]
    assert "fault injection" in job.output
    for rank in range(2):
        assert delayed.losses(rank) == calm.losses(rank), f"rank {rank}: losses changed under lane delays"
    a, b = calm.state(), delayed.state()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} changed under lane delays"


@pytest.mark.integration
def test_random_lane_delays_leave_every_matrix_combination_bit_identical(job_runner):
    calm = run_matrix(job_runner)
    delayed = run_matrix(job_runner, "slidedp_matrix_delayed", env=DELAYS)
    assert "fault injection" in delayed.output
    differ = [n for n in ["p1", *MATRIX] if differing(matrix_result(calm, n), matrix_result(delayed, n))]
    assert not differ, f"{len(differ)} combinations changed under lane delays: {differ}"
