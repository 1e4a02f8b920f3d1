"""Reading torch files (weights, checkpoints) so that the file cannot choose how much memory the
read takes: torch.save writes a zip archive, and a crafted one can deflate a few KB into GBs
that torch.load would inflate before any key is checked."""

from __future__ import annotations

import io
import warnings
import zipfile
from typing import Any

import torch


def load_tensors(raw: bytes, limit: int) -> Any:
    """torch.load(weights_only=True) of `raw` once its members are shown to inflate to at most
    `limit` bytes (ValueError otherwise). Reads only the zip directory before that."""
    if zipfile.is_zipfile(io.BytesIO(raw)):
        with zipfile.ZipFile(io.BytesIO(raw)) as zf:
            inflated = sum(info.file_size for info in zf.infolist())
        if inflated > limit:
            raise ValueError(f"it would inflate to {inflated} bytes, over the {limit} allowed")
    with warnings.catch_warnings():  # torch warns about pickle protocols on odd files
        warnings.simplefilter("ignore")
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
