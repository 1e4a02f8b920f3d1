"""The accelerator: where training runs (`--device`, torch's device; "device" elsewhere in the
project is the edge device a bundle runs on) and in what precision its forward passes run
(`--precision`). Chosen once per run; CPU in fp32 is the reference path every bit-equal test pins,
and an accelerator only changes where the same code runs."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from fed_train.errors import KnnperError

if TYPE_CHECKING:  # torch loads when a device is resolved: the parsers name DEVICES first
    import torch

DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
PRECISIONS: tuple[str, ...] = ("fp32", "bf16")


class DeviceError(KnnperError, RuntimeError):
    """A device that this machine does not have."""


def resolve_device(name: str) -> torch.device:
    """ "auto": the GPU when torch sees one, else the CPU; "cuda" without one is an error (one
    line, exit 2) rather than a silent fall-back that would run 50x slower than asked."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            cuda = torch.version.cuda
            built = "without CUDA" if cuda is None else f"with CUDA {cuda}"
            raise DeviceError(
                f"--device cuda: no CUDA device is available (torch "
                f"{torch.__version__}, built {built}); use --device cpu or auto"
            )
        return torch.device("cuda")
    raise DeviceError(f"unknown device {name!r}; known: {', '.join(DEVICES)}")


def autocast(device: torch.device | str, precision: str) -> AbstractContextManager:
    """The forward pass's precision: fp32 changes nothing; bf16 autocasts matrix products and
    convolutions (weights, gradients and optimiser state stay fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16":
        import torch

        kind = device.type if isinstance(device, torch.device) else str(device)
        return torch.autocast(kind, dtype=torch.bfloat16)
    raise ValueError(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")
