"""The tables are written as their jobs end, and again when the run is interrupted (no benchmark runs here)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench.baselines.runner import RunResult
from bench.configs import plan, scale
from bench.report import BenchReport
from bench.suite import TABLES, Suite

REPO = Path(__file__).resolve().parents[2]


def fake_init(shape, seq: int, root: Path) -> Path:
    return root / f"init-{shape.name}-{seq}.pt"


def finished(runs) -> list[RunResult]:
    """Every run ok, 0.1 s steps, 1 GB + 20 B/param of host memory."""
    out = []
    for name, spec in runs:
        r = RunResult(name, spec, step_s=[0.1] * (spec.steps - spec.warmup - 1), losses=[2.0] * spec.steps)
        r.host_peak = int(1e9 + 20 * spec.model.num_params)
        out.append(r)
    return out


def make_suite(tmp_path: Path, run, tables=("systems",), blocked=None) -> tuple[Suite, list[str]]:
    sc = scale("cpu", fast=True)
    lines: list[str] = []
    suite = Suite(sc, plan(sc, tmp_path / "init", init=fake_init), BenchReport(tmp_path), list(tables), lines.append,
                  blocked, run=run)  # fmt: skip
    return suite, lines


def row(md: str, system: str, model: str) -> str:
    return next(line for line in md.splitlines() if line.startswith(f"| {model} |") and f"| {system} |" in line)


def test_the_table_is_written_after_each_job_with_pending_runs(tmp_path):
    calls = []

    def run(runs, out):
        calls.append(runs[0][0])
        if len(calls) == 2:  # the first job has ended: its table is on disk already
            md = (tmp_path / "report.md").read_text()
            assert "| slidedp | 640 | 100 |" in row(md, "slidedp", "h512-L2")  # 2 x 32 tokens in 0.1 s
            assert "pending" in row(md, "ddp", "h512-L2")
        return finished(runs)

    suite, lines = make_suite(tmp_path, run)
    suite.table("systems")
    assert calls == [n for n in suite.jobs if n.startswith("systems/")] and len(calls) == 14
    md = (tmp_path / "report.md").read_text()
    assert "pending" not in md
    assert lines[0].startswith("[1/14] systems/h512-L2/slidedp: ok")


def test_an_interrupted_run_writes_every_table_with_what_ran(tmp_path):
    def run(runs, out):
        if runs[0][0] == "systems/h512-L2/ddp":
            raise KeyboardInterrupt
        return finished(runs)

    suite, _ = make_suite(tmp_path, run, tables=("systems", "slope", "loss"))
    with pytest.raises(KeyboardInterrupt):
        suite.table("systems")
    suite.finish()
    suite.report.write(final=True)
    md = (tmp_path / "report.md").read_text()
    assert "interrupted" in row(md, "ddp", "h512-L2")
    assert "not run" in row(md, "fsdp2", "h512-L2")
    slidedp = row(md, "slidedp", "h512-L2")
    assert "not run" not in slidedp and "interrupted" not in slidedp  # it finished: its numbers are in
    assert "#### Host memory slope" in md
    assert "#### Loss equivalence" not in md  # no loss run finished: nothing to show yet
    assert (tmp_path / "plots" / "throughput.png").exists()


def test_a_blocked_system_is_reported_without_running(tmp_path):
    ran = []

    def run(runs, out):
        ran.append(runs[0][1].system)
        return finished(runs)

    why = "failed: DeepSpeed's cpu_adam op did not build in 1200 s (log x)"
    suite, _ = make_suite(tmp_path, run, blocked={"zero_offload": why})
    res = suite.table("systems")
    assert "zero_offload" not in ran
    r = res["systems/h512-L2/zero_offload"]
    assert (r.status, r.reason) == ("failed", why)


def test_every_quick_table_has_a_definition_and_runs():
    sc = scale("cpu", fast=True)
    names = {r.name for j in plan(sc, Path("/nonexistent"), init=fake_init) for r in j.runs}
    for name, table in TABLES.items():
        if table.quick:
            assert any(n.startswith(table.prefixes) for n in names), name


@pytest.mark.slow  # a subprocess of its own: out of the fast tier
def test_sigterm_stops_the_run_and_the_tables_are_written(tmp_path):
    """A SIGTERM during a job ends the run as Ctrl-C does (bench/conftest.py): the table is on disk after."""
    script = textwrap.dedent(
        f"""
        import signal, sys, time
        from pathlib import Path
        sys.path.insert(0, {str(REPO)!r})
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from bench.conftest import _interrupt
        from test_suite import finished, make_suite
        signal.signal(signal.SIGTERM, _interrupt)
        out = Path({str(tmp_path)!r})

        def run(runs, folder):
            if runs[0][0] == "systems/h512-L2/ddp":
                print("running", flush=True)
                time.sleep(60)
            return finished(runs)

        suite, _ = make_suite(out, run)
        try:
            suite.table("systems")
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        finally:
            suite.finish()
            suite.report.write()
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout.readline().strip() == "running"
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert "interrupted" in out
    md = (tmp_path / "report.md").read_text()
    assert "interrupted" in row(md, "ddp", "h512-L2") and "not run" in row(md, "fsdp2", "h512-L8")
