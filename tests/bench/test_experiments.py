"""experiments/table_*.py: importing runs nothing, and each parses ``--help``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
SCRIPTS = sorted(EXPERIMENTS.glob("table_*.py"))


def load(path: Path):
    if str(EXPERIMENTS) not in sys.path:
        sys.path.insert(0, str(EXPERIMENTS))
    spec = importlib.util.spec_from_file_location(f"experiments_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_script_per_paper_table():
    names = {p.stem for p in SCRIPTS}
    assert names == {
        f"table_{t}"
        for t in (
            "throughput",
            "memory",
            "host_slope",
            "scaling",
            "chunking",
            "autopolicy",
            "routes",
            "loss_equivalence",
        )
    }


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_help(path: Path, capsys):
    module = load(path)
    assert module.PAPER.strip()
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--scale" in out and "--ranks" in out and "--quick" in out
