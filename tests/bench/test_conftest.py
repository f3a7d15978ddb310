"""The benchmark's pytest options (bench/conftest.py): documented in --help, selecting tables, and no warning for
pyproject's ``timeout`` key when pytest-timeout is absent. Each case collects only: no benchmark runs."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.conftest import ALL_TABLES

REPO = Path(__file__).resolve().parents[2]


class Collected:
    """A plugin that keeps the names of the tests a session collected (after deselection)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.names = [item.name for item in session.items]


def collect(*args: str) -> list[str]:
    plugin = Collected()
    code = pytest.main([str(REPO / "bench"), "--rootdir", str(REPO), "-p", "no:cacheprovider", "--collect-only",
                        "-q", *args], plugins=[plugin])  # fmt: skip
    assert code == 0
    return plugin.names


def functions(names: list[str]) -> set[str]:
    return {n.split("[")[0] for n in names}


@pytest.mark.slow  # a subprocess of its own: out of the fast tier
def test_no_unknown_timeout_option_without_pytest_timeout(tmp_path):
    def run(*args: str, cwd: Path) -> str:
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:timeout", "--collect-only", "-q"]
        got = subprocess.run([*cmd, *args], cwd=cwd, capture_output=True, text=True, timeout=300)
        return got.stdout + got.stderr

    assert "Unknown config option" not in run("bench/", cwd=REPO)
    # the same key without the benchmark's conftest is warned about: the check above can see the warning
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 600\n")
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    assert "Unknown config option: timeout" in run(cwd=tmp_path)


def test_help_documents_quick_strict_and_every_table(capsys):
    assert pytest.main([str(REPO / "bench"), "--rootdir", str(REPO), "-p", "no:cacheprovider", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--bench-quick", "--bench-table", "--bench-strict", "--bench-sizes", "--bench-rounds"):
        assert option in text
    assert all(f"{name} (" in text for name in ALL_TABLES)


def test_quick_selects_the_paper_comparison_and_the_kernel_suites():
    names = collect("--benchmark", "--bench-quick")
    # the kernel suites are skipped at collection without threadpoolctl (the [bench] extra; CI installs [dev])
    kernels = {"test_cpu_adam", "test_adamw8_kernel"} if importlib.util.find_spec("threadpoolctl") else set()
    assert functions(names) - kernels == {
        "test_throughput",
        "test_memory",
        "test_host_memory_slope",
        "test_routes",
        "test_chunking",
        "test_autopolicy",
        "test_loss_equivalence",
    }
    assert kernels <= functions(names)
    sizes = {n.split("[")[1].split("-")[0] for n in names if "[" in n}
    assert sizes == ({"4M"} if kernels else set())  # the kernel suites at their smallest size only


@pytest.mark.slow  # a subprocess of its own: out of the fast tier
def test_one_table_alone():
    assert functions(collect("--benchmark", "--bench-table", "systems")) == {"test_throughput"}
    assert functions(collect("--benchmark", "--bench-table", "capacity", "moe")) == {"test_capacity", "test_moe"}


class BenchmarkSession:
    """A plugin that keeps whether pytest-benchmark times the session's benchmarks."""

    disabled: bool | None = None

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.disabled = session.config._benchmarksession.disabled


def test_benchmark_times_despite_pyprojects_dist_and_refuses_workers(monkeypatch, capsys):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # this test's own worker, if any
    args = [str(REPO / "bench"), "--rootdir", str(REPO), "-p", "no:cacheprovider", "--collect-only", "-q"]
    plugin = BenchmarkSession()
    assert pytest.main([*args, "--benchmark", "--bench-table", "systems"], plugins=[plugin]) == 0  # (with [dev] only)
    assert plugin.disabled is False  # pyproject's addopts hold --dist loadfile: pytest-benchmark saw "no"
    if importlib.util.find_spec("xdist"):
        assert pytest.main([*args, "--benchmark", "-n", "2"]) == pytest.ExitCode.USAGE_ERROR
        assert "drop -n / --numprocesses" in capsys.readouterr().err


def test_without_benchmark_everything_is_skipped():
    assert "test_throughput" in functions(collect())  # collected, each skipped (no --benchmark)


def test_a_benchmark_that_ignores_sigint_says_how_to_stop_it(capsys):
    def header(*args: str) -> str:
        argv = [str(REPO / "bench"), "--rootdir", str(REPO), "-p", "no:cacheprovider", "--collect-only", *args]
        assert pytest.main(argv) == 0
        return " ".join(capsys.readouterr().out.split())

    stop = "Ctrl-C and kill -INT do not stop it; SIGTERM or SIGHUP does"
    assert stop not in header("--benchmark")
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background command of a non-interactive shell
    try:
        assert stop in header("--benchmark") and stop not in header()
    finally:
        signal.signal(signal.SIGINT, previous)
