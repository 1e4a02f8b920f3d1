"""What `knnper export`'s choice flags take: light on purpose (no torch, no onnx), so that its
command line is parsed and a bad flag refused before the exporter is imported."""

from __future__ import annotations

from edge_runtime.datastores import BACKENDS

DEVICE_EXTRAS = ("any", "none")  # --device-extras: "none" tries only what the runtime alone loads


def backend_choices() -> tuple[str, ...]:
    """What --backend takes: "auto" (every registered backend) or one registered backend."""
    return ("auto", *BACKENDS)
