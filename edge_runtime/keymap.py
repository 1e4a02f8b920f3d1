"""A server-fitted map from one encoder's embedding space to the next one's, as a release ships
it and a device reads it (`knnper-edge upgrade`): z_new = z_old @ weight + bias.

The file is an .npz of plain arrays, read like any bundle file (bounded, no pickle, every shape
and value checked before use): weight float32 [p_old, p_new], bias float32 [p_new], the two
encoders' embedding ids (uint8[32] each, edge_runtime.versions), the server's advice (0: map the
keys, 1: keep the old keys, 2: start fresh) and its evidence, kNN accuracies on held-out server
data as float64 [mapped, stale, re-embedded, new global model alone].

Optionally (releases from the ProtoNN upgrade on; both or neither) the reverse map, fitted the
same way from the new space back to the old, z_old = z_new @ reverse_weight + reverse_bias:
reverse_weight float32 [p_new, p_old], reverse_bias float32 [p_old]. A ProtoNN datastore folds
it into its projection (ProtoNNDatastore.fold_input_map): its prototypes stay where they were
trained and the new encoder's queries are taken back to them. A map file without it still loads;
a ProtoNN bundle then cannot be upgraded with it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._io import load_npz, save_npz_atomic
from .versions import id_array, id_from_arrays, short

ADVICE = ("map the keys", "keep the old keys", "start fresh")
EVIDENCE = ("mapped", "stale", "re-embedded", "global")
MAP_ARRAYS = ("weight", "bias", "from_embedding", "to_embedding", "advice", "evidence")
REVERSE_ARRAYS = ("reverse_weight", "reverse_bias")
# The widest map a device reads (the manifests' MAX_WIDTH squared would be 16 GiB).
MAX_MAP_WIDTH = 4096
# the forward and the reverse map's arrays
MAX_MAP_BYTES = 2 * 4 * MAX_MAP_WIDTH * (MAX_MAP_WIDTH + 1) + 64 * 1024
# Rows mapped at a time: bounds what an upgrade holds widened.
MAP_CHUNK_ROWS = 1024


@dataclass(frozen=True)
class KeyMap:
    """A checked map (see the module docstring)."""

    weight: np.ndarray
    bias: np.ndarray
    from_embedding: str
    to_embedding: str
    advice: str
    evidence: dict[str, float]
    # the reverse map (new space -> old), None in a release without it
    reverse_weight: np.ndarray | None = None
    reverse_bias: np.ndarray | None = None

    def apply(self, z: np.ndarray) -> np.ndarray:
        """Old keys [n, p_old] -> new keys [n, p_new], float32."""
        return (np.asarray(z, np.float32) @ self.weight + self.bias).astype(np.float32)

    def chunks(self, rows, count: int) -> Iterator[np.ndarray]:
        """`rows(start, stop)` (old keys) mapped a chunk at a time."""
        for start in range(0, count, MAP_CHUNK_ROWS):
            yield self.apply(rows(start, min(count, start + MAP_CHUNK_ROWS)))

    def save(self, path: str | os.PathLike) -> None:
        save_npz_atomic(
            Path(path),
            {
                "weight": np.ascontiguousarray(self.weight, np.float32),
                "bias": np.ascontiguousarray(self.bias, np.float32),
                "from_embedding": id_array(self.from_embedding),
                "to_embedding": id_array(self.to_embedding),
                "advice": np.int8(ADVICE.index(self.advice)),
                "evidence": np.array([self.evidence[k] for k in EVIDENCE], np.float64),
                **(
                    {}
                    if self.reverse_weight is None
                    else {
                        "reverse_weight": np.ascontiguousarray(self.reverse_weight, np.float32),
                        "reverse_bias": np.ascontiguousarray(self.reverse_bias, np.float32),
                    }
                ),
            },
        )

    def describe(self) -> str:
        figures = ", ".join(f"{k} {100 * v:.2f}%" for k, v in self.evidence.items())
        return (
            f"map {short(self.from_embedding)} -> {short(self.to_embedding)}: the server "
            f"advises to {self.advice} (kNN accuracy on held-out server data: {figures})"
        )


def load_key_map(path: str | os.PathLike) -> KeyMap:
    """Read and check a map file; ValueError (one line, naming the file) if it is not one."""
    path = Path(path)
    name = path.name
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ValueError(f"key map {path}: cannot read it: {exc.strerror}") from None
    if size > MAX_MAP_BYTES:
        raise ValueError(f"key map {path}: {size} bytes, over the {MAX_MAP_BYTES} a map may take")
    try:
        arrays = load_npz(path)
    except (ValueError, OSError, EOFError) as exc:
        raise ValueError(f"key map {path}: not a readable .npz: {exc}") from None
    except Exception as exc:  # zipfile.BadZipFile and kin
        raise ValueError(f"key map {path}: not a readable .npz ({type(exc).__name__})") from None
    if sorted(arrays) not in (sorted(MAP_ARRAYS), sorted(MAP_ARRAYS + REVERSE_ARRAYS)):
        raise ValueError(
            f"key map {path}: holds {sorted(arrays)}, a map holds {sorted(MAP_ARRAYS)} "
            f"(and, with its reverse, {list(REVERSE_ARRAYS)})"
        )
    weight, bias = arrays["weight"], arrays["bias"]
    if (
        weight.dtype != np.float32
        or weight.ndim != 2
        or not 1 <= min(weight.shape) <= max(weight.shape) <= MAX_MAP_WIDTH
    ):
        raise ValueError(
            f"key map {path}: weight must be float32 [p_old, p_new] of at most "
            f"{MAX_MAP_WIDTH} each, got {weight.dtype} {list(weight.shape)}"
        )
    if bias.dtype != np.float32 or bias.shape != (weight.shape[1],):
        raise ValueError(
            f"key map {path}: bias must be float32 [{weight.shape[1]}], got "
            f"{bias.dtype} {list(bias.shape)}"
        )
    if not (np.isfinite(weight).all() and np.isfinite(bias).all()):
        raise ValueError(f"key map {path}: weight and bias must be finite")
    advice, evidence = arrays["advice"], arrays["evidence"]
    if advice.shape != () or advice.dtype.kind not in "iu" or not 0 <= int(advice) < len(ADVICE):
        raise ValueError(f"key map {path}: advice must be one integer in [0, {len(ADVICE)})")
    if (
        evidence.dtype != np.float64
        or evidence.shape != (len(EVIDENCE),)
        or not np.all((evidence >= 0) & (evidence <= 1))
    ):
        raise ValueError(
            f"key map {path}: evidence must be {len(EVIDENCE)} float64 accuracies in [0, 1]"
        )
    ids = [
        id_from_arrays({"embedding_id": arrays[k]}, f"{name} {k}")
        for k in ("from_embedding", "to_embedding")
    ]
    return KeyMap(
        weight,
        bias,
        ids[0],
        ids[1],
        ADVICE[int(advice)],
        dict(zip(EVIDENCE, map(float, evidence), strict=True)),
        *_reverse(arrays, weight.shape, path),
    )


def _reverse(
    arrays: dict[str, np.ndarray], forward: tuple[int, int], path: Path
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The checked reverse map (weight [p_new, p_old], bias [p_old]), or (None, None)."""
    if "reverse_weight" not in arrays:
        return None, None
    weight, bias = arrays["reverse_weight"], arrays["reverse_bias"]
    p_old, p_new = forward
    if weight.dtype != np.float32 or weight.shape != (p_new, p_old):
        raise ValueError(
            f"key map {path}: reverse_weight must be float32 [{p_new}, {p_old}] (the "
            f"forward weight transposed in shape), got {weight.dtype} {list(weight.shape)}"
        )
    if bias.dtype != np.float32 or bias.shape != (p_old,):
        raise ValueError(
            f"key map {path}: reverse_bias must be float32 [{p_old}], got "
            f"{bias.dtype} {list(bias.shape)}"
        )
    if not (np.isfinite(weight).all() and np.isfinite(bias).all()):
        raise ValueError(f"key map {path}: reverse_weight and reverse_bias must be finite")
    return weight, bias
