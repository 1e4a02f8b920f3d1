"""The datastore backends by name. A backend is one module, a `BaseDatastore` subclass that
declares on its class what the rest of the code asks of it (its files, recipe tokens, ONNX form,
device extra, the sizer's search axes, its memory model), plus one `register_backend` call;
every caller looks the class up here instead of testing the backend's name."""

from __future__ import annotations

from typing import Any

BACKENDS: dict[str, Any] = {}  # name -> BaseDatastore subclass, in registration order


def register_backend(cls: Any) -> Any:
    """Make `cls` (a BaseDatastore subclass with a `backend` name) loadable and nameable in
    recipes; returns it, so it also serves as a class decorator."""
    if not cls.backend:
        raise ValueError(f"{cls.__name__} declares no backend name")
    BACKENDS[cls.backend] = cls
    return cls


def backend_class(name: str) -> Any:
    """The class registered as `name`; ValueError naming the known ones otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"unknown datastore backend {name!r}; known: {sorted(BACKENDS)}")
    return BACKENDS[name]
