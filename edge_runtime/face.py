"""A package's public face, loaded on first use (PEP 562): `from edge_runtime import Runtime`
works, while importing one module of the package (`edge_runtime._io` from the trainer, say) does
not pay for onnxruntime or torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_face(
    package: str, names: Mapping[str, str]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """`__all__`, `__getattr__` and `__dir__` for `package`, whose public `names` live in the
    given submodules (`{"Runtime": "runtime"}`: `package.runtime.Runtime`)."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{names[name]}"), name)

    def __dir__() -> list[str]:
        return sorted(names)

    return sorted(names), __getattr__, __dir__
