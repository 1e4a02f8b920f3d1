"""The benchmark scripts of benchmarks/ as modules, so experiments reuse their code (CSV and
markdown helpers, the distribution-shift experiment, the ProtoNN grid) instead of copying it.
They are scripts, not a package: each imports its sibling `_common` from its own folder."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

from experiments.spec import ExperimentError

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_module(name: str) -> ModuleType:
    """benchmarks/NAME.py, imported once (a source checkout has it; a wheel does not)."""
    if not (BENCHMARKS / f"{name}.py").is_file():
        raise ExperimentError(f"{BENCHMARKS / name}.py not found: this experiment runs the "
                              "benchmark scripts of a source checkout of knnper")
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)
