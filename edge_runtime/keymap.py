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

The map's form (export.map_forms chooses it by cross-validation on the server): an optional
`form` int8 scalar, 0 "linear" (also what a file without it is), 1 "per-class".
weight and bias are always the linear part (what a linear fold, like ProtoNN's, can use); a
per-class map adds, for a key of class c (the label the datastore stores beside it), its
class's correction: z @ (weight + class_weight[c]) + bias + class_bias[c], with class_weight
float32 [C, p_old, p_new] and class_bias float32 [C, p_new] (finite; C the bundle's number of
classes). Every form is applied MAP_CHUNK_ROWS keys at a time, numpy only; a form's arrays
take at most MAX_FORM_BYTES, and a device reads class_weight from the file one class at a time
(ClassWeights) rather than holding all C of them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._io import NpzRows, check_npz_members, save_npz_atomic
from .versions import ModelVersion

ADVICE = ("map the keys", "keep the old keys", "start fresh")
EVIDENCE = ("mapped", "stale", "re-embedded", "global")
MAP_ARRAYS = ("weight", "bias", "from_embedding", "to_embedding", "advice", "evidence")
REVERSE_ARRAYS = ("reverse_weight", "reverse_bias")
FORMS = ("linear", "per-class")
FORM_ARRAYS = {"linear": (), "per-class": ("class_weight", "class_bias")}
# The widest map a device reads (the manifests' MAX_WIDTH squared would be 16 GiB).
MAX_MAP_WIDTH = 4096
# what a form's correction may add (a per-class map of 10 classes at width 1024 takes 40 MiB)
MAX_FORM_BYTES = 4 * MAX_MAP_WIDTH * (MAX_MAP_WIDTH + 1)
# the forward and the reverse map's arrays, and a form's
MAX_MAP_BYTES = 2 * 4 * MAX_MAP_WIDTH * (MAX_MAP_WIDTH + 1) + MAX_FORM_BYTES + 64 * 1024
# Rows mapped at a time: bounds what an upgrade holds widened (a few float32 copies of 256 x
# p; 1024 rows took an upgrade of 10,000 int8 keys 0.9 MiB past its budget + 2 MiB).
MAP_CHUNK_ROWS = 256


@dataclass(frozen=True)
class KeyMap:
    """A checked map (see the module docstring)."""

    weight: np.ndarray
    bias: np.ndarray
    from_version: ModelVersion  # the old encoder's (its embedding only)
    to_version: ModelVersion
    advice: str
    evidence: dict[str, float]
    # the reverse map (new space -> old), None in a release without it
    reverse_weight: np.ndarray | None = None
    reverse_bias: np.ndarray | None = None
    form: str = "linear"
    # the form's arrays (a loaded per-class map's class_weight: ClassWeights, read in turn)
    extra: dict[str, Any] = field(default_factory=dict)

    def apply(self, z: np.ndarray, labels: np.ndarray | None = None) -> np.ndarray:
        """Old keys [n, p_old] (of classes `labels`, for a per-class map) -> new keys
        [n, p_new], float32."""
        return apply_map(self.form, self.weight, self.bias, self.extra, z, labels)

    def chunks(self, rows, count: int, labels: np.ndarray | None = None) -> Iterator[np.ndarray]:
        """`rows(start, stop)` (old keys, of classes labels[start:stop]) mapped a chunk at a
        time."""
        for start in range(0, count, MAP_CHUNK_ROWS):
            stop = min(count, start + MAP_CHUNK_ROWS)
            yield self.apply(rows(start, stop), None if labels is None else labels[start:stop])

    def save(self, path: str | os.PathLike) -> None:
        save_npz_atomic(
            Path(path),
            {
                "weight": np.ascontiguousarray(self.weight, np.float32),
                "bias": np.ascontiguousarray(self.bias, np.float32),
                "from_embedding": self.from_version.as_array(),
                "to_embedding": self.to_version.as_array(),
                "advice": np.int8(ADVICE.index(self.advice)),
                "evidence": np.array([self.evidence[k] for k in EVIDENCE], np.float64),
                **({} if self.form == "linear" else {"form": np.int8(FORMS.index(self.form))}),
                **{name: np.ascontiguousarray(a, np.float32) for name, a in self.extra.items()},
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
            f"{self.form} map {self.from_version.short} -> {self.to_version.short}: "
            f"the server advises to {self.advice} (kNN accuracy on held-out server data: {figures})"
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
        arrays = _load_arrays(path)
    except (ValueError, OSError, EOFError) as exc:
        raise ValueError(f"key map {path}: not a readable .npz: {exc}") from None
    except Exception as exc:  # zipfile.BadZipFile and kin
        raise ValueError(f"key map {path}: not a readable .npz ({type(exc).__name__})") from None
    form = _form(arrays, path)
    base = MAP_ARRAYS + FORM_ARRAYS[form] + (("form",) if "form" in arrays else ())
    if sorted(arrays) not in (sorted(base), sorted(base + REVERSE_ARRAYS)):
        raise ValueError(
            f"key map {path}: holds {sorted(arrays)}, a {form} map holds {sorted(base)} "
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
        ModelVersion.from_array(arrays[k], f"{name} {k}")
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
        form,
        _form_arrays(form, arrays, weight.shape, path),
    )


def apply_map(
    form: str,
    weight: np.ndarray,
    bias: np.ndarray,
    extra: dict[str, Any],
    z: np.ndarray,
    labels: np.ndarray | None = None,
) -> np.ndarray:
    """Old keys [n, p_old] -> new keys [n, p_new], float32, by a map of `form` (see the module
    docstring); `labels` (the keys' classes) for a per-class map."""
    z = np.asarray(z, np.float32)
    out = z @ weight + bias
    if form == "per-class":
        if labels is None or len(labels) != len(z):
            raise ValueError("a per-class key map needs the label of every key")
        labels = np.asarray(labels)
        # an array's rows, or a file's classes read in turn (ClassWeights)
        for c, class_weight in enumerate(extra["class_weight"]):
            rows = labels == c
            if rows.any():
                out[rows] += z[rows] @ class_weight + extra["class_bias"][c]
    return out.astype(np.float32, copy=False)


class ClassWeights:
    """A per-class map file's class_weight [C, p_old, p_new], read one class at a time each
    time it is iterated: what an upgrade holds is one class's [p_old, p_new], not all C."""

    def __init__(self, path: Path) -> None:
        self.path = path
        rows = NpzRows(path, ["class_weight"])  # checks the header against the member's size
        self.shape, self.dtype = rows.shapes["class_weight"], rows.dtypes["class_weight"]
        self._stamp = _stamp(path)

    def __iter__(self) -> Iterator[np.ndarray]:
        # what was checked (and verified, for a signed release) is what is read again
        if _stamp(self.path) != self._stamp:
            raise ValueError(f"key map {self.path}: changed while it was in use; run again")
        for (chunk,) in NpzRows(self.path, ["class_weight"]).chunks(1):
            yield chunk[0]


def _stamp(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def _load_arrays(path: Path) -> dict:
    """Every array of the map file, class_weight left in the file (ClassWeights)."""
    check_npz_members(path)
    with np.load(path, allow_pickle=False) as f:
        return {name: ClassWeights(path) if name == "class_weight" else f[name] for name in f.files}


def _form(arrays: dict[str, np.ndarray], path: Path) -> str:
    if "form" not in arrays:
        return "linear"
    form = arrays["form"]
    if form.shape != () or form.dtype.kind not in "iu" or not 0 <= int(form) < len(FORMS):
        raise ValueError(
            f"key map {path}: form must be one integer in [0, {len(FORMS)}) ({', '.join(FORMS)})"
        )
    return FORMS[int(form)]


def _form_arrays(
    form: str, arrays: dict[str, np.ndarray], forward: tuple[int, int], path: Path
) -> dict[str, np.ndarray]:
    """The checked arrays of a form's correction (shapes, dtype, size, finite values)."""
    if form == "linear":
        return {}
    p_old, p_new = forward
    names = FORM_ARRAYS[form]
    cw = arrays["class_weight"]
    classes = cw.shape[0] if len(cw.shape) == 3 else 0
    shapes = {"class_weight": (classes, p_old, p_new), "class_bias": (classes, p_new)}
    for name in names:
        a = arrays[name]
        if a.dtype != np.float32 or a.shape != shapes[name] or not 1 <= classes <= MAX_MAP_WIDTH:
            want = ", ".join(str(d) for d in shapes[name])
            raise ValueError(
                f"key map {path}: {name} of a {form} map must be float32 [{want}] "
                f"(1 to {MAX_MAP_WIDTH} classes), got {a.dtype} {list(a.shape)}"
            )
    total = 4 * sum(int(np.prod(arrays[name].shape)) for name in names)
    if total > MAX_FORM_BYTES:
        raise ValueError(
            f"key map {path}: the {form} map's arrays take {total} bytes, over the "
            f"{MAX_FORM_BYTES} a map's form may add"
        )
    finite = np.isfinite(arrays["class_bias"]).all() and all(
        np.isfinite(w).all() for w in arrays["class_weight"]
    )
    if not finite:
        raise ValueError(f"key map {path}: {', '.join(names)} must be finite")
    return {name: arrays[name] for name in names}


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
