"""The import graph of the library, the kernels, the command line and the benchmark: no cycle in any of them or
across them, no checkpoint module imports a Lightning adapter, and the library never imports the command line
(docs/ARCHITECTURE.md, "Layers").

Read with ``ast``, nothing imported. Every import counts, also one inside a function or under ``TYPE_CHECKING``:
each is an arrow a reader follows, and a lazy import that closes a cycle only hides it.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("slidedp_lightning", "cpu_ops", "slidedp_lightning_cli", "bench")
ADAPTERS = {f"slidedp_lightning.{m}" for m in ("strategy", "fabric", "lifecycle", "precision", "callbacks", "checks")}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _known(name: str) -> str | None:
    """``name`` or the closest package above it that is one of ours (None: another project's)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    """Our modules that ``module`` imports; ``from package import name`` imports ``package.name`` where that is a
    module, else ``package``."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(_known(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            out.update(_known(f"{base}.{alias.name}") for alias in node.names)
    return {m for m in out if m is not None and m != module}


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as err:
        return list(err.args[1])
    return []


def _within(package: str) -> dict[str, set[str]]:
    return {m: {d for d in ds if d.split(".")[0] == package} for m, ds in GRAPH.items() if m.split(".")[0] == package}


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package: str) -> None:
    graph = _within(package)
    assert len(graph) > 1
    cycle = _cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_across_packages() -> None:
    cycle = _cycle(GRAPH)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_library_never_imports_the_command_line() -> None:
    cli = {m for m in GRAPH if m.startswith("slidedp_lightning_cli")}
    assert len(cli) >= 3
    assert {m: sorted(d & cli) for m, d in GRAPH.items() if m.startswith("slidedp_lightning.") and d & cli} == {}


def test_a_cycle_is_found() -> None:
    graph = _within("slidedp_lightning")
    assert "slidedp_lightning.constants" in graph["slidedp_lightning.strategy"]
    graph["slidedp_lightning.constants"].add("slidedp_lightning.strategy")
    assert {"slidedp_lightning.constants", "slidedp_lightning.strategy"} <= set(_cycle(graph))


def test_no_checkpoint_module_imports_an_adapter() -> None:
    checkpoints = [m for m in GRAPH if m.startswith("slidedp_lightning.checkpoints")]
    assert len(checkpoints) >= 7
    assert {m: sorted(GRAPH[m] & ADAPTERS) for m in checkpoints if GRAPH[m] & ADAPTERS} == {}
    assert ADAPTERS <= set(MODULES)
