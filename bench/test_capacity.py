"""``pytest bench/ --benchmark -k capacity``: the largest model each system fine-tunes on this host (bench.capacity).

About an hour on a 2-core, 24 GB host; ``--capacity-tiny`` runs the same procedure on a tiny shape in minutes. The
table and its JSON go to ``<bench results>/capacity/``; a system that fits nothing is a row, not a failure.
"""

from __future__ import annotations

import pytest

from bench import capacity


def test_capacity(bench_report, request: pytest.FixtureRequest) -> None:
    out = bench_report.out / "capacity"
    argv = ["--out", str(out)] + (["--tiny"] if request.config.getoption("--capacity-tiny") else [])
    assert capacity.main(argv) == 0
    table = (out / "capacity.md").read_text()
    assert all(f"| {label} |" in table for label in capacity.SYSTEMS), "every system has its row"
    bench_report.notes["capacity"].append(table)
