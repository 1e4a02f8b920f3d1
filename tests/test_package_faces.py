"""Each package's curated face: every name in `__all__` resolves to the object its module
defines, nothing else is offered, and the face costs nothing until a name is used (importing
the device runtime's package does not load onnxruntime, and never loads torch)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PACKAGES = ("edge_runtime", "protonn", "fed_train", "export", "experiments")


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_resolves_to_its_definition(package):
    module = importlib.import_module(package)
    assert module.__all__ == sorted(module.__all__) and module.__all__
    assert dir(module) == module.__all__
    for name in module.__all__:
        value = getattr(module, name)
        defined_in = getattr(value, "__module__", None)
        if defined_in is not None:  # classes and functions: defined inside the package
            assert defined_in.startswith(package + "."), (name, defined_in)


@pytest.mark.parametrize("package", PACKAGES)
def test_an_unknown_name_is_an_attribute_error(package):
    module, unknown = importlib.import_module(package), "Nope"
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        getattr(module, unknown)


def test_the_runtime_face_loads_onnxruntime_on_use_and_never_torch():
    code = (
        "import sys, edge_runtime, edge_runtime._io\n"
        "assert 'onnxruntime' not in sys.modules\n"
        "from edge_runtime import Runtime, write_bundle\n"
        "assert 'onnxruntime' in sys.modules and 'torch' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
