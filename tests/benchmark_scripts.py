"""Loading a script of benchmarks/ as a module, for the unit tests of its pure parts (the scripts are
no package: each runs as `python benchmarks/NAME.py`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str) -> ModuleType:
    """benchmarks/`name`.py as the module `name`_bench."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"{name}_bench"] = module  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(module)
    return module
