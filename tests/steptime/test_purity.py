"""The step-time model is pure arithmetic: no module of ``slidedp_lightning.steptime`` but ``calibrate`` reaches
the runtime, the kernels, Lightning or Numba, directly or through the modules it imports.

The check reads each module's own import graph with ``ast`` and never imports it: importing
``slidedp_lightning.steptime.x`` executes ``slidedp_lightning/__init__.py``, which imports Lightning to register
the strategy, so ``sys.modules`` after an import says nothing about what the step-time model itself needs.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from slidedp_lightning import constants
from slidedp_lightning.steptime import graph

PACKAGE = Path(__file__).resolve().parents[2] / "slidedp_lightning"
STEPTIME = PACKAGE / "steptime"
FORBIDDEN = ("slidedp_lightning.runtime", "cpu_ops", "lightning", "numba")
# measures the hardware with the runtime and the kernels: the one module allowed to import them, and only from
# inside a function (a lazy import), so that importing another step-time module never loads it
CALIBRATE = "slidedp_lightning.steptime.calibrate"


def _module_file(name: str) -> Path | None:
    """The source file of a ``slidedp_lightning`` module, or None for any other module."""
    parts = name.split(".")
    if parts[0] != "slidedp_lightning":
        return None
    base = PACKAGE.parent.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path, module: str) -> list[tuple[str, bool]]:
    """``(module, lazy)`` for every import in the file of ``module``; ``lazy``: inside a function body.

    ``from package import name`` yields ``package.name`` too where that is a module, since it imports it.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, inner) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    anchor = package[: len(package) - child.level + 1]
                    base = ".".join(anchor + ([child.module] if child.module else []))
                else:
                    base = child.module or ""
                found.append((base, inner))
                for alias in child.names:
                    if _module_file(f"{base}.{alias.name}") is not None:
                        found.append((f"{base}.{alias.name}", inner))
            visit(child, inner)

    visit(tree, False)
    return found


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def _executed(name: str) -> list[str]:
    """The ``slidedp_lightning`` modules importing ``name`` executes: its packages' ``__init__`` and itself.

    The root package is left out (its ``__init__`` registers the strategy with Lightning; see the module
    docstring).
    """
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts) + 1)] if parts[0] == "slidedp_lightning" else []


def _violations(start: Path, module: str | None = None) -> list[str]:
    """Import chains from ``start`` to a forbidden module, following ``slidedp_lightning`` modules transitively.

    ``calibrate`` is not followed, and an import of it must be lazy.
    """
    bad: list[str] = []
    seen: set[str] = set()
    stack: list[tuple[Path, list[str]]] = [(start, [module or _module_name(start)])]
    while stack:
        path, chain = stack.pop()
        for name, lazy in _imports(path, chain[-1]):
            route = " -> ".join([*chain, name])
            if _forbidden(name):
                bad.append(route)
                continue
            for target in _executed(name):
                if target == CALIBRATE:
                    if not lazy:
                        bad.append(f"{route} (calibrate imports the runtime: import it inside a function)")
                elif target not in seen and (file := _module_file(target)) is not None:
                    seen.add(target)
                    stack.append((file, [*chain, target]))
    return sorted(bad)


MODULES = sorted(p for p in STEPTIME.glob("*.py") if p.name != "calibrate.py")


def test_every_module_is_checked():
    names = {p.stem for p in MODULES}
    assert {"__init__", "__main__", "analytic", "graph", "simulate", "traces", "microbench"} <= names
    assert (STEPTIME / "calibrate.py").is_file()


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_steptime_module_is_pure(path: Path):
    assert _violations(path) == []


def test_check_sees_a_forbidden_import(tmp_path: Path):
    """Imports of the runtime, the kernels, Lightning or Numba are caught, module-level or lazy; so is a
    module-level import of ``calibrate``."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import numba\n"
        "from slidedp_lightning.steptime import calibrate\n"
        "from .graph import LANES\n"
        "def f():\n"
        "    from lightning.pytorch import Trainer\n"
        "    from slidedp_lightning.runtime.trace import Tracer\n"
        "    return Trainer, Tracer, LANES\n"
    )
    name = "slidedp_lightning.steptime.probe"
    assert _violations(probe, name) == [
        f"{name} -> lightning.pytorch",
        f"{name} -> numba",
        f"{name} -> slidedp_lightning.runtime.trace",
        f"{name} -> slidedp_lightning.steptime.calibrate (calibrate imports the runtime: import it inside a function)",
    ]


def test_check_follows_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A forbidden import two modules away is caught, with the chain that reaches it."""
    inner = tmp_path / "inner.py"
    inner.write_text("from slidedp_lightning.runtime.trace import Tracer\n")
    outer = tmp_path / "outer.py"
    outer.write_text("from slidedp_lightning.steptime.graph import LANES\nfrom . import inner\n")
    real = _module_file
    fake = "slidedp_lightning.steptime.inner"
    monkeypatch.setattr(sys.modules[__name__], "_module_file", lambda name: inner if name == fake else real(name))
    assert _violations(outer, "slidedp_lightning.steptime.outer") == [
        f"slidedp_lightning.steptime.outer -> {fake} -> slidedp_lightning.runtime.trace"
    ]


def test_shared_names_come_from_constants():
    """The model's routes, layouts and ledger size are the runtime's, defined once in ``constants``."""
    assert graph.GRAD_ROUTES is constants.GRAD_ROUTES
    assert graph.HOST_LAYOUTS is constants.HOST_LAYOUTS
    assert graph.LEDGER_BYTES_PER_PARAM == constants.LEDGER_BYTES_PER_PARAM
    assert graph.PARAM_ROUTES == (*constants.PARAM_ROUTES, "slideformer")
    assert set(graph.PRECISIONS) <= set(constants.PRECISIONS)
