"""``pytest bench/ --benchmark``: benchmark suites, off unless asked for.

Options: ``--benchmark`` (run them), ``--bench-results DIR`` (where tables, JSON and TensorBoard runs go;
default ``results/bench-<UTC time>``), ``--bench-sizes 4 16 64 256`` (millions of parameters),
``--bench-rounds N`` (measured interleaved rounds after one warm-up round), ``--scale cpu|gpu`` and
``--bench-ranks R`` (the systems suite: CPU scale by default; ``gpu`` needs CUDA and uses Qwen3-4B/8B/14B shapes).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench.report import BenchReport


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("slidedp benchmarks")
    group.addoption("--benchmark", action="store_true", default=False, help="run the benchmark suites in bench/")
    group.addoption("--bench-results", default=None, help="results directory (default results/bench-<UTC time>)")
    group.addoption(
        "--bench-sizes",
        type=int,
        nargs="+",
        default=[4, 16, 64, 256],
        help="parameter counts in millions for the CPU update benchmark",
    )
    group.addoption("--bench-rounds", type=int, default=5, help="measured interleaved rounds per configuration")
    group.addoption("--scale", choices=("cpu", "gpu"), default="cpu", help="systems suite scale (gpu needs CUDA)")
    group.addoption("--bench-ranks", type=int, default=None, help="ranks of the systems suite (cpu: 2, gpu: 4)")
    group.addoption(
        "--capacity-tiny", action="store_true", default=False, help="bench.capacity on a tiny shape (minutes)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--benchmark"):
        return
    skip = pytest.mark.skip(reason="benchmarks run only with `pytest bench/ --benchmark`")
    for item in items:
        item.add_marker(skip)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "size_m" in metafunc.fixturenames:
        metafunc.parametrize("size_m", metafunc.config.getoption("--bench-sizes"), ids=lambda m: f"{m}M")


@pytest.fixture(scope="session")
def bench_report(request: pytest.FixtureRequest):
    root = request.config.getoption("--bench-results")
    out = Path(root) if root else Path("results") / time.strftime("bench-%Y%m%d-%H%M%S", time.gmtime())
    report = BenchReport(out)
    yield report
    request.config.stash[_WRITTEN] = (report, report.write())


_WRITTEN = pytest.StashKey[tuple]()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    written = config.stash.get(_WRITTEN, None)
    if written is None:
        return
    report, paths = written
    terminalreporter.section("slidedp benchmark report")
    for text in report.markdown_sections():
        terminalreporter.write_line(text)
    terminalreporter.write_line(f"results: {', '.join(str(p) for p in paths)}")


@pytest.fixture(scope="session")
def bench_rounds(request: pytest.FixtureRequest) -> int:
    return request.config.getoption("--bench-rounds")


@pytest.fixture(scope="session")
def bench_scale(request: pytest.FixtureRequest):
    from bench.configs import scale

    name = request.config.getoption("--scale")
    if name == "gpu":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("--scale gpu needs CUDA")
    return scale(name, request.config.getoption("--bench-ranks"))
