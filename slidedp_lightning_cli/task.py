"""The job's plain-Python modules, read without the library's ``__init__`` (which imports Lightning and torch to
register the strategy): :mod:`slidedp_lightning.recipes.settings` (the flags' defaults and checks),
:mod:`slidedp_lightning.recipes.plan` (the job's memory before anything loads), with the modules they import;
:mod:`slidedp_lightning.process.early_ranks` (the job's other ranks, started before the imports); and,
for ``--dry-run --hardware`` only, the step-time simulator (:func:`load_simulator`).

Each is loaded from its file under its own name and kept in ``sys.modules``, so the library, imported once the flags
are checked, finds it there (one module, one ``TaskSpec`` class).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

# in the order they import each other; each imports nothing but the standard library and those before it
PLAIN = (
    "slidedp_lightning.constants",
    "slidedp_lightning.runtime.host_os",
    "slidedp_lightning.steptime.workload",
    "slidedp_lightning.recipes.settings",
    "slidedp_lightning.recipes.plan",
    "slidedp_lightning.process.early_ranks",
)
# what plan.predicted_step imports (after PLAIN, in the same order rule): read only for ``--hardware``
SIMULATOR = (
    "slidedp_lightning.intervals",
    "slidedp_lightning.steptime.profiles",
    "slidedp_lightning.steptime.graph",
    "slidedp_lightning.steptime.slideformer",
    "slidedp_lightning.steptime.ops",
    "slidedp_lightning.steptime.simulate",
)


def _load(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    if "slidedp_lightning" in sys.modules:  # the library is imported already: the ordinary way costs nothing more
        return importlib.import_module(name)
    library = importlib.util.find_spec("slidedp_lightning")  # finds the package without running its __init__
    if library is None or not library.submodule_search_locations:
        raise ImportError("slidedp_lightning is not installed: pip install -e . from the repository")
    path = Path(next(iter(library.submodule_search_locations)), *name.split(".")[1:]).with_suffix(".py")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot read {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_simulator() -> None:
    """Read the step-time simulator's modules (:data:`SIMULATOR`) the same way, so that
    :func:`slidedp_lightning.recipes.plan.predicted_step` imports them without the library."""
    for name in SIMULATOR:
        _load(name)


if TYPE_CHECKING:
    from slidedp_lightning.process import early_ranks
    from slidedp_lightning.recipes import plan, settings
else:
    for _name in PLAIN:
        _load(_name)
    settings, plan = sys.modules["slidedp_lightning.recipes.settings"], sys.modules["slidedp_lightning.recipes.plan"]
    early_ranks = sys.modules["slidedp_lightning.process.early_ranks"]


__all__ = ["early_ranks", "load_simulator", "plan", "settings"]
