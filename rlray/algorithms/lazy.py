"""rl_math, loaded on its first use.

The registries (estimators.py, losses.py) are read by the config's checks and --help in
the driver, a process that never imports torch (memory it would hold all run long);
their entries call rl_math only when a learner runs them.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType


def lazy_module(name: str) -> ModuleType:
    """Returns the module `name`, to be executed on first attribute access (the standard
    library's LazyLoader); an already imported module as it is."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(name)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


rl_math = lazy_module("rlray.algorithms.rl_math")
