"""``pytest bench/ --benchmark``: benchmark suites, off unless asked for (``pytest bench/ --help`` lists the options).

Every table is written into ``--bench-results`` (``report.md``, CSV, JSON, PNG plots, TensorBoard) as soon as its
jobs end, rewritten after every job, and again when the run is interrupted (Ctrl-C, SIGTERM, SIGHUP). Targets are
verdicts at the top of ``report.md``; they fail the run only with ``--bench-strict``. One-time costs (initial
weights, Numba kernels, DeepSpeed's op build) are paid up front, outside the jobs' timeouts, with progress lines.
"""

from __future__ import annotations

import logging
import signal
import time
from contextlib import nullcontext
from pathlib import Path

import pytest

from bench.report import BenchReport, Verdict
from bench.suite import TABLES

log = logging.getLogger(__name__)
KERNEL_TABLES = ("cpu_adam", "adamw8_kernel")
ALL_TABLES = (*TABLES, *KERNEL_TABLES, "capacity")
QUICK_TABLES = tuple(t for t, d in TABLES.items() if d.quick) + KERNEL_TABLES
DEFAULT_SIZES, QUICK_SIZES = [4, 16, 64, 256], [4]
DEFAULT_ROUNDS, QUICK_ROUNDS = 5, 3
HELP_TABLES = ", ".join(f"{t} ({d.about})" for t, d in TABLES.items()) + (
    ", cpu_adam (the CPU update vs torch / DeepSpeed / the bandwidth ceiling), adamw8_kernel (the 8-bit-moment "
    "kernel), capacity (the largest model per system: about an hour, minutes with --capacity-tiny)"
)


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    group = parser.getgroup("slidedp benchmarks", "slidedp benchmarks (pytest bench/ --benchmark ...)")
    group.addoption(
        "--benchmark",
        action="store_true",
        default=False,
        help="run the benchmark suites in bench/: every table at full size (the long run; capacity alone takes about "
        "an hour), or those of --bench-quick / --bench-table",
    )
    group.addoption(
        "--bench-quick",
        action="store_true",
        default=False,
        help="every table of the paper comparison at small sizes in about 10 min on 2 cores: systems and memory "
        "(every system at 2 model sizes), slope (SlideDP and replicated at 3 sizes), routes, chunking, autopolicy, "
        f"loss, and the kernel suites at {QUICK_SIZES[0]} M params, {QUICK_ROUNDS} rounds",
    )
    group.addoption(
        "--bench-table",
        nargs="+",
        choices=ALL_TABLES,
        default=None,
        metavar="NAME",
        help=f"run only these tables (with or without --bench-quick): {HELP_TABLES}",
    )
    group.addoption(
        "--bench-strict",
        action="store_true",
        default=False,
        help="a missed target (speed ratio, memory slope, loss bound) fails its test; without it targets are "
        "verdicts in report.md only",
    )
    group.addoption("--bench-results", default=None, help="results directory (default results/bench-<UTC time>)")
    group.addoption(
        "--bench-sizes",
        type=int,
        nargs="+",
        default=None,
        help=f"kernel suites: parameter counts in millions (default {DEFAULT_SIZES}; quick {QUICK_SIZES})",
    )
    group.addoption(
        "--bench-rounds",
        type=int,
        default=None,
        help=f"kernel suites: measured interleaved rounds after one warm-up (default {DEFAULT_ROUNDS}; quick "
        f"{QUICK_ROUNDS})",
    )
    group.addoption("--scale", choices=("cpu", "gpu"), default="cpu", help="systems suite scale (gpu needs CUDA)")
    group.addoption("--bench-ranks", type=int, default=None, help="ranks of the systems suite (cpu: 2, gpu: 4)")
    group.addoption(
        "--capacity-tiny", action="store_true", default=False, help="bench.capacity on a tiny shape (minutes)"
    )
    if not pluginmanager.has_plugin("timeout"):  # pyproject's `timeout` key belongs to pytest-timeout ([dev])
        parser.addini("timeout", "per-test time limit of pytest-timeout (not installed here: no limit)", default="0")


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_PREVIOUS = pytest.StashKey[dict]()


@pytest.hookimpl(tryfirst=True)  # before pytest-benchmark's, which reads --dist
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "bench_table(name): the table a benchmark test writes (--bench-table)")
    if not config.pluginmanager.has_plugin("timeout"):
        config.addinivalue_line("markers", "timeout(seconds): pytest-timeout's limit (ignored without pytest-timeout)")
    if config.getoption("--benchmark"):
        if config.getoption("numprocesses", None):
            raise pytest.UsageError(
                "--benchmark runs one test at a time (timings side by side in one process): drop -n / --numprocesses"
            )
        # pyproject's --dist is for the tests' -n runs; pytest-benchmark reads any --dist as "distributed" and would
        # time nothing (every kernel case NaN)
        config.option.dist = "no"
        # SIGTERM / SIGHUP end the run as Ctrl-C does: the jobs are killed and every table is written
        config.stash[_PREVIOUS] = {s: signal.signal(s, _interrupt) for s in _SIGNALS}


def pytest_report_header(config: pytest.Config) -> str | None:
    if config.getoption("--benchmark") and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # what a shell without job control does to a background command: the kernel drops every SIGINT
        return (
            "SIGINT is ignored by this process (started in the background): Ctrl-C and kill -INT do not stop it; "
            "SIGTERM or SIGHUP does, and its jobs go with it"
        )
    return None


def pytest_unconfigure(config: pytest.Config) -> None:
    for s, handler in config.stash.get(_PREVIOUS, {}).items():
        signal.signal(s, handler)


def selected_tables(config: pytest.Config) -> tuple[str, ...]:
    chosen = config.getoption("--bench-table")
    if chosen:
        return tuple(chosen)
    return QUICK_TABLES if config.getoption("--bench-quick") else ALL_TABLES


def table_of(item: pytest.Item) -> str:
    """The table a benchmark test writes: its ``bench_table`` marker, else its module's name without ``test_``."""
    marker = item.get_closest_marker("bench_table")
    if marker is not None:
        return marker.args[0]
    return Path(str(item.fspath)).stem.removeprefix("test_")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--benchmark"):
        skip = pytest.mark.skip(reason="benchmarks run only with `pytest bench/ --benchmark`")
        for item in items:
            item.add_marker(skip)
        return
    chosen = set(selected_tables(config))
    keep = [i for i in items if table_of(i) in chosen]
    dropped = [i for i in items if table_of(i) not in chosen]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def bench_sizes(config: pytest.Config) -> list[int]:
    sizes = config.getoption("--bench-sizes")
    return sizes or (QUICK_SIZES if config.getoption("--bench-quick") else DEFAULT_SIZES)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "size_m" in metafunc.fixturenames:
        metafunc.parametrize("size_m", bench_sizes(metafunc.config), ids=lambda m: f"{m}M")


_REPORT = pytest.StashKey[BenchReport]()
_WRITTEN = pytest.StashKey[tuple]()


def results_dir(config: pytest.Config) -> Path:
    root = config.getoption("--bench-results")
    return Path(root) if root else Path("results") / time.strftime("bench-%Y%m%d-%H%M%S", time.gmtime())


class Progress:
    """Progress lines: shown at once (past pytest's output capture) and appended to ``progress.log``."""

    def __init__(self, config: pytest.Config, out: Path) -> None:
        self.config, self.path = config, out / "progress.log"

    def __call__(self, message: str) -> None:
        line = f"[bench {time.strftime('%H:%M:%S')}] {message}"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")
        log.info(message)
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        capman = self.config.pluginmanager.get_plugin("capturemanager")
        if tr is None:
            return
        with capman.global_and_fixture_disabled() if capman is not None else nullcontext():
            tr.ensure_newline()
            tr.write_line(line)


@pytest.fixture(scope="session")
def bench_report(request: pytest.FixtureRequest):
    report = BenchReport(results_dir(request.config))
    report.strict = request.config.getoption("--bench-strict")
    request.config.stash[_REPORT] = report
    yield report
    request.config.stash[_WRITTEN] = (report, report.write(final=True))


@pytest.fixture(scope="session")
def bench_progress(request: pytest.FixtureRequest, bench_report) -> Progress:
    return Progress(request.config, bench_report.out)


@pytest.fixture(scope="session")
def bench_prepared(request: pytest.FixtureRequest, bench_report, bench_progress, bench_scale):
    """The one-time costs (bench/prepare.py), once per session; DeepSpeed only where a selected table uses it."""
    from bench.prepare import prepare

    uses_deepspeed = {"systems", "memory", "slope", "moe", "cpu_adam"}
    prep = prepare(
        bench_scale.accelerator,
        bench_scale.ranks,
        bench_report.out,
        bench_progress,
        needs_deepspeed=bool(uses_deepspeed & set(selected_tables(request.config))),
    )
    bench_report.timings.update(prep.timings)
    for note in prep.notes:
        bench_report.note("one-time costs", note)
    return prep


@pytest.fixture(scope="session")
def bench_check(request: pytest.FixtureRequest, bench_report):
    """``check(verdicts, record=True)``: record them in the report (written at once; ``record=False``: they are
    recorded already, as the kernel suites' ratios); with --bench-strict a missed one fails the calling test, after
    its table is written."""

    def check(verdicts: list[Verdict], record: bool = True) -> None:
        missed = bench_report.check(verdicts, record)
        if missed:
            pytest.fail("target missed (--bench-strict): " + "; ".join(missed), pytrace=False)

    return check


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    report = item.config.stash.get(_REPORT, None)
    if report is not None:
        report.write()  # the kernel suites' measurements so far


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    written = config.stash.get(_WRITTEN, None)
    if written is None:
        return
    report, paths = written
    terminalreporter.section("slidedp benchmark report")
    for text in report.markdown_sections():
        terminalreporter.write_line(text)
    terminalreporter.write_line(report.verdict_section())
    terminalreporter.write_line(f"results: {', '.join(str(p) for p in paths)}")


@pytest.fixture(scope="session")
def bench_tables(request: pytest.FixtureRequest) -> tuple[str, ...]:
    """The tables this session runs (--bench-table, --bench-quick)."""
    return selected_tables(request.config)


@pytest.fixture(scope="session")
def bench_rounds(request: pytest.FixtureRequest) -> int:
    rounds = request.config.getoption("--bench-rounds")
    return rounds or (QUICK_ROUNDS if request.config.getoption("--bench-quick") else DEFAULT_ROUNDS)


@pytest.fixture(scope="session")
def bench_scale(request: pytest.FixtureRequest):
    from bench.configs import scale

    name = request.config.getoption("--scale")
    if name == "gpu":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("--scale gpu needs CUDA")
    return scale(name, request.config.getoption("--bench-ranks"), fast=request.config.getoption("--bench-quick"))
