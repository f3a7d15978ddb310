"""SlideDP against FSDP2 (with and without CPU offload), ZeRO-Offload, the replicated mode and DDP (arXiv 2609.34162, §4).

Every system runs as its own multi-process job (``bench/baselines/job.py``) in a subprocess with a timeout, on
the workload of ``bench/configs.py`` (the same model, initial weights, data, batch, sequence length, steps and
optimizer hyper-parameters for every system compared; checked by ``tests/bench/test_configs.py``). A system that
cannot run is reported with its reason. The tables go to ``--bench-results`` (markdown, CSV, TensorBoard).
The acceptance checks (host-memory slope, loss equivalence) run last, after every table is written.
ZeRO-Offload needs DeepSpeed (``pip install -e ".[bench]"``); without it its runs are reported ``unavailable``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from bench import tables
from bench.baselines.runner import RunResult, run_job
from bench.configs import Job, plan

log = logging.getLogger(__name__)
SUITE = tables.SUITE
# each test may start many jobs (the first starts all 30 of the systems table): pytest's 600 s default is too short
pytestmark = pytest.mark.timeout(3600)


class Results:
    """Runs each job once per session, on first use; keeps every run's result by name."""

    def __init__(self, jobs: list[Job], out: Path, report) -> None:
        self.jobs = {j.name: j for j in jobs}
        self.out, self.report = out, report
        self.done: dict[str, RunResult] = {}
        self.ran: set[str] = set()

    def need(self, *prefixes: str) -> dict[str, RunResult]:
        for name, job in self.jobs.items():
            if name in self.ran or not any(r.name.startswith(prefixes) for r in job.runs):
                continue
            t0 = time.time()
            results = run_job([(r.name, r.spec) for r in job.runs], self.out / "jobs" / name)
            self.ran.add(name)
            print(f"\n{name}: {time.time() - t0:.1f} s, " + ", ".join(f"{r.name} {r.status}" for r in results))
            for r in results:
                if not job.memory:  # a shared job's host memory belongs to all its runs: not reported per run
                    r.host_peak = r.host_peak_run = r.host_peak_shmem = r.rss_sum_peak = 0
                self.done[r.name] = r
                self.report.runs[r.name] = r.summary()
                for i, loss in enumerate(r.losses):
                    self.report.scalar(f"loss/{r.name}", loss, i)
                for i, s in enumerate(r.step_s):
                    self.report.scalar(f"step_s/{r.name}", s, r.spec.warmup + i)
        return self.done


@pytest.fixture(scope="session")
def results(bench_scale, bench_report) -> Results:
    jobs = plan(bench_scale, bench_report.out / "init")
    bench_report.note(SUITE, f"scale {bench_scale.name}: {bench_scale.ranks} ranks on {bench_scale.accelerator}")
    if bench_scale.accelerator == "cpu":
        bench_report.note(
            SUITE,
            "CPU-only machine: the accelerator is the CPU, so 'offload' (ZeRO-Offload, FSDP2 "
            "CPUOffloadPolicy, SlideDP's streaming) moves no data across PCIe; host-to-device "
            "copies are copies within host memory",
        )
    return Results(jobs, bench_report.out, bench_report)


def _add(report, tabs) -> None:
    for t in tabs:
        report.table(t)
        print("\n" + t.markdown())


def _every_system_accounted(runs: list[RunResult]) -> None:
    for r in runs:
        assert r.ok or r.reason, f"{r.name} did not run and gave no reason"


def test_throughput(results, bench_scale, bench_report):
    res = results.need("systems/")
    _add(bench_report, tables.throughput(res, bench_scale))
    _every_system_accounted([r for k, r in res.items() if k.startswith("systems/")])


def test_memory(results, bench_scale, bench_report):
    _add(bench_report, tables.memory(results.need("systems/"), bench_scale))


def test_scaling(results, bench_scale, bench_report):
    _add(bench_report, tables.scaling(results.need("variants/", "scaling/"), bench_scale))


def test_chunking(results, bench_scale, bench_report):
    _add(bench_report, tables.chunking(results.need("variants/", "chunking/"), bench_scale))


def test_autopolicy(results, bench_scale, bench_report):
    _add(bench_report, tables.autopolicy(results.need("autopolicy/"), bench_scale))


def test_moe(results, bench_scale, bench_report):
    res = results.need("moe/")
    _add(bench_report, tables.moe(res, bench_scale))
    _every_system_accounted(list(res.values()))


def test_long_context(results, bench_scale, bench_report):
    res = results.need("long/")
    _add(bench_report, tables.long_context(res, bench_scale))
    assert res["long/slidedp"].ok, f"SlideDP must train the long sequence: {res['long/slidedp'].reason}"


def test_routes(results, bench_scale, bench_report):
    _add(bench_report, tables.routes(results.need("variants/", "routes/"), bench_scale))


def test_host_memory_slope(results, bench_scale, bench_report):
    """One ledger per host instead of one per rank: SlideDP's ledger slope is at most 1/R of the replicated
    mode's; and SlideDP's whole host slope (ledger + the ranks' private memory) is at most 14.5 GB per billion
    parameters. (The whole slopes are 14 + p and R x 14 + p with p the private part, so "SlideDP's whole slope
    <= the replicated mode's / R" would need p <= 0; see docs/PERFORMANCE.md, "Host memory slope".)"""
    slopes = tables.host_slopes(results.need("systems/"), bench_scale)
    _add(bench_report, [slopes.table])
    total, ledger = slopes.total, slopes.ledger
    assert "slidedp" in total and "replicated" in total, "SlideDP and the replicated mode must both run"
    assert "slidedp" in ledger and "replicated" in ledger, "SlideDP and the replicated mode must report their ledgers"
    assert ledger["slidedp"] > 0, f"SlideDP's ledger slope {ledger['slidedp']:.3f} GB/B: no ledger measured"
    bound = ledger["replicated"] / bench_scale.ranks
    assert ledger["slidedp"] <= bound, (
        f"SlideDP ledger slope {ledger['slidedp']:.4f} GB/B > replicated ledger slope / R = {bound:.4f}"
    )
    assert total["slidedp"] <= 14.5, f"SlideDP host slope {total['slidedp']:.2f} GB/B > 14.5"


def test_loss_equivalence(results, bench_report):
    table, diffs = tables.loss_equivalence(results.need("loss/"))
    _add(bench_report, [table])
    assert set(diffs) == {"32-true", "bf16-mixed"}, "both precisions must run for SlideDP and FSDP2"
    assert diffs["32-true"] <= 1e-4
    assert diffs["bf16-mixed"] <= 1e-2
