"""The job's settings and the synthetic task's shape, :mod:`slidedp_lightning.recipes.settings`, read without the
library's ``__init__`` (which imports Lightning and torch to register the strategy).

That module is plain Python: it is loaded from its file under its own name and kept in ``sys.modules``, so the
library, imported once the flags are checked, finds it there (one module, one ``TaskSpec`` class).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

NAME = "slidedp_lightning.recipes.settings"


def _load() -> ModuleType:
    if NAME in sys.modules:
        return sys.modules[NAME]
    if "slidedp_lightning" in sys.modules:  # the library is imported already: the ordinary way costs nothing more
        return importlib.import_module(NAME)
    library = importlib.util.find_spec("slidedp_lightning")  # finds the package without running its __init__
    if library is None or not library.submodule_search_locations:
        raise ImportError("slidedp_lightning is not installed: pip install -e . from the repository")
    path = Path(next(iter(library.submodule_search_locations))) / "recipes" / "settings.py"
    spec = importlib.util.spec_from_file_location(NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot read the job's settings from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[NAME]
        raise
    return module


if TYPE_CHECKING:
    from slidedp_lightning.recipes import settings
else:
    settings = _load()

__all__ = ["settings"]
