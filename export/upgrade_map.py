"""The server's half of a model update: a map from an older release's embedding space to the new
one, fitted only on data the server holds, with the evidence that it helps, written beside the
new bundles as upgrades/from-<old encoder id>.npz (edge_runtime.keymap) for `knnper-edge
upgrade`. The map's form and strength (export.map_forms: ridge, ridge on standardised inputs,
low-rank, per-class) are chosen by k-fold cross-validation on a seeded part of the server data,
by the kNN accuracy a device would get from the mapped keys (the release's k and sigma), not by
the squared error alone; every candidate's scores go into the evidence JSON. The rest is held
out for the evidence: half of it plays a device's memory, the other half its queries (embedded
by the new encoder), and the device's own kNN (a flat datastore with the release's k and sigma)
is scored with the memory's keys mapped, left stale (old keys searched with new queries), and
re-embedded (what kept inputs give), beside the new global model alone.
The release advises to map the keys when the mapped keys score at least the stale ones; else,
to keep the old keys (stay on the old version) when stale keys still beat the global model, and
to start fresh otherwise.

The reverse map (new space -> old, what a ProtoNN bundle folds into its projection) is ridge,
fitted on the same samples, its strength chosen by cross-validated squared error, and judged
beside the others: the memory's old keys searched with the queries mapped back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge_runtime._io import write_bytes_atomic
from edge_runtime.datastores import EXACT_RECIPE, make_datastore
from edge_runtime.encoder import Encoder
from edge_runtime.keymap import ADVICE, MAX_FORM_BYTES, KeyMap
from edge_runtime.preprocess import prepare_input
from edge_runtime.release import ReleaseError, read_release
from edge_runtime.upgrade import UPGRADES_DIR, map_file_name
from edge_runtime.versions import ModelVersion
from export.errors import ExportError
from export.map_forms import (
    CV_FOLDS,
    RIDGE_ALPHAS,
    Candidate,
    best_alpha,
    candidates,
    choose,
    cross_validate,
    fit_candidate,
    folds_of,
    ridge,
)

# the forms tried beside plain ridge (export.map_forms)
MAP_FORMS = ("ridge standardised", "low-rank", "per-class")
HELD_OUT_FRACTION = 0.4
# Server samples used at most: the fit is a p x p solve, the evidence a kNN over half the rest.
MAX_SERVER_SAMPLES = 10_000


@dataclass
class MapFit:
    """A fitted map and how it was chosen."""

    key_map: KeyMap
    chosen: Candidate
    cv: dict[Candidate, dict[str, float]]  # every candidate's knn_accuracy and mse
    fit_samples: int
    held_out_samples: int
    reverse_alpha: float
    reverse_cv_mse: dict[float, float]
    reverse_evidence: float  # kNN accuracy of the old keys, queries mapped back

    def to_dict(self) -> dict[str, Any]:
        return {
            "form": self.chosen.name(),
            "device_form": self.key_map.form,
            "alpha": self.chosen.alpha,
            "criterion": f"{CV_FOLDS}-fold cross-validated kNN accuracy of the mapped keys "
            "(leave-own-out, the release's k and sigma); ties to the lower mean squared error",
            "cv": {c.name(): scores for c, scores in self.cv.items()},
            "fit_samples": self.fit_samples,
            "held_out_samples": self.held_out_samples,
            "advice": self.key_map.advice,
            "evidence_knn_accuracy": self.key_map.evidence,
            "reverse": {
                "alpha": self.reverse_alpha,
                "cv_mse": {f"{a:g}": m for a, m in self.reverse_cv_mse.items()},
                "evidence_knn_accuracy_queries_mapped_back": self.reverse_evidence,
            },
            "from_embedding": self.key_map.from_version.embedding,
            "to_embedding": self.key_map.to_version.embedding,
        }


def choose_alpha(
    x: np.ndarray, y: np.ndarray, seed: int, alphas=RIDGE_ALPHAS, folds: int = CV_FOLDS
) -> tuple[float, dict[float, float]]:
    """The ridge strength of the least cross-validated mean squared error (ties: stronger):
    the reverse map's (a ProtoNN projection folds it; its queries are not a device's keys)."""
    fold = folds_of(len(x), seed, folds)
    mse = {}
    for alpha in alphas:
        errors = []
        for f in range(folds):
            train, test = fold != f, fold == f
            w, b = ridge(x[train], y[train], alpha)
            errors.append(float(np.mean((x[test] @ w + b - y[test]) ** 2)))
        mse[alpha] = float(np.mean(errors))
    best = min(mse.values())
    return max(a for a, m in mse.items() if m <= best * (1 + 1e-9)), mse


def knn_accuracy(
    keys: np.ndarray,
    labels: np.ndarray,
    queries: np.ndarray,
    truth: np.ndarray,
    num_classes: int,
    k: int,
    sigma: float,
) -> float:
    ds = make_datastore(EXACT_RECIPE, num_classes, k=k, sigma=sigma).fit(keys, labels)
    return float((ds.predict_proba(queries).argmax(1) == truth).mean())


def _advice(evidence: dict[str, float]) -> str:
    """Map the keys where mapped keys score at least the stale ones; else keep the old keys
    where they score at least the global model; else start fresh."""
    if evidence["mapped"] >= evidence["stale"]:
        return ADVICE[0]
    return ADVICE[1] if evidence["stale"] >= evidence["global"] else ADVICE[2]


def fit_key_map(
    z_old: np.ndarray,
    z_new: np.ndarray,
    logits_new: np.ndarray,
    y: np.ndarray,
    old: ModelVersion,
    new: ModelVersion,
    *,
    num_classes: int,
    k: int = 10,
    sigma: float = 1.0,
    seed: int = 0,
    forms: tuple[str, ...] = MAP_FORMS,
) -> MapFit:
    """Fit and judge the map on server samples embedded by both encoders (see the module
    docstring); `forms`: those tried beside plain ridge (export.map_forms)."""
    n = len(y)
    if n < 4 * CV_FOLDS:
        raise ExportError(
            f"fitting a key map needs at least {4 * CV_FOLDS} server samples, got {n}"
        )
    order = np.random.default_rng([seed, 0x3A8]).permutation(n)
    held = int(round(HELD_OUT_FRACTION * n))
    fit, memory, queries = order[held:], order[: held // 2], order[held // 2 : held]
    x_fit, y_fit, labels_fit = z_old[fit], z_new[fit], y[fit]

    def cv(cands: list[Candidate]) -> dict[Candidate, dict[str, float]]:
        return cross_validate(
            cands, x_fit, y_fit, labels_fit, num_classes, k=k, sigma=sigma, seed=seed
        )

    if 4 * num_classes * (z_old.shape[1] + 1) * z_new.shape[1] > MAX_FORM_BYTES:
        forms = tuple(f for f in forms if f != "per-class")  # a device would refuse the file
    scores = cv(candidates(0.0, ()))
    scores.update(cv(candidates(best_alpha(scores), forms)[len(RIDGE_ALPHAS) :]))
    chosen = choose(scores)
    fitted = fit_candidate(chosen, x_fit, y_fit, labels_fit, num_classes)
    reverse_alpha, reverse_mse = choose_alpha(z_new[fit], z_old[fit], seed)
    rw, rb = ridge(z_new[fit], z_old[fit], reverse_alpha)

    def score(keys: np.ndarray, q: np.ndarray) -> float:
        return knn_accuracy(keys, y[memory], q, y[queries], num_classes, k, sigma)

    new_queries = z_new[queries]
    # Old keys cannot be searched by queries of another width: staying on the old version then
    # means the old encoder's queries too.
    stale_queries = new_queries if z_old.shape[1] == z_new.shape[1] else z_old[queries]
    evidence = {
        "mapped": score(fitted.apply(z_old[memory], y[memory]), new_queries),
        "stale": score(z_old[memory], stale_queries),
        "re-embedded": score(z_new[memory], new_queries),
        "global": float((logits_new[queries].argmax(1) == y[queries]).mean()),
    }
    key_map = KeyMap(
        fitted.weight,
        fitted.bias,
        old,
        new,
        _advice(evidence),
        evidence,
        rw,
        rb,
        fitted.form,
        fitted.extra,
    )
    return MapFit(
        key_map,
        chosen,
        scores,
        len(fit),
        held,
        reverse_alpha,
        reverse_mse,
        score(z_old[memory], new_queries @ rw + rb),
    )


def write_upgrade_map(
    old_export: Path,
    new_export: Path,
    x: np.ndarray,
    y: np.ndarray,
    input_spec: dict,
    num_classes: int,
    *,
    k: int,
    sigma: float,
    seed: int = 0,
    signing_key: Any = None,
) -> tuple[Path, MapFit]:
    """Fit the map from `old_export`'s encoder to `new_export`'s on the server's (x, y) and
    write it (and its evidence as JSON, and its signature with `signing_key`) into
    new_export/upgrades/."""
    old_encoder, new_encoder = old_export / "encoder.onnx", new_export / "encoder.onnx"
    for path in (old_encoder, new_encoder):
        if not path.is_file():
            raise ExportError(f"{path.parent} is not an export directory (no encoder.onnx)")
    if len(y) > MAX_SERVER_SAMPLES:
        keep = np.sort(
            np.random.default_rng([seed, 0x3A7]).choice(len(y), MAX_SERVER_SAMPLES, replace=False)
        )
        x, y = x[keep], y[keep]
    xp = prepare_input(x, input_spec)
    z_old, _ = Encoder(old_encoder, intra_op_threads=None).run(xp)
    z_new, logits = Encoder(new_encoder, intra_op_threads=None).run(xp)
    old, new = (ModelVersion.of_encoder(p.read_bytes()) for p in (old_encoder, new_encoder))
    result = fit_key_map(
        z_old,
        z_new,
        logits,
        np.asarray(y),
        old,
        new,
        num_classes=num_classes,
        k=k,
        sigma=sigma,
        seed=seed,
    )
    directory = new_export / UPGRADES_DIR
    directory.mkdir(exist_ok=True)
    path = directory / map_file_name(old)
    result.key_map.save(path)
    write_bytes_atomic(
        path.with_suffix(".json"), (json.dumps(result.to_dict(), indent=2) + "\n").encode()
    )
    if signing_key is not None:
        from edge_runtime.signing import sign_file

        sign_file(path, signing_key)
    return path, result


def server_data(run, public_data: str | None) -> tuple[np.ndarray, np.ndarray]:
    """Data the server holds, never a client's: `public_data` (an npz with x_train, y_train),
    else the split the run's pretraining kept for the server (`knnper pretrain`, then `knnper
    train --init PRETRAIN_DIR`). ExportError when there is neither."""
    from fed_train.data import load_dataset, load_server_arrays
    from fed_train.errors import DataError
    from fed_train.pretrain import load_init
    from fed_train.run import server_split_source

    source = server_split_source(run.config)
    if public_data is None and source is not None:
        init = load_init(source)
        public_data = (init.record or {}).get("public_data")
        if public_data is None and init.server_indices is not None and len(init.server_indices):
            full = load_dataset(run.config.dataset, run.config.data, seed=run.config.seed)
            return full.x_train[init.server_indices], full.y_train[init.server_indices]
    if public_data is None:
        raise ExportError(
            "--upgrade-from fits its key map on data only the server holds: give "
            "--public-data NPZ (x_train, y_train), or train the run from a "
            "pretraining on a server split (knnper pretrain, knnper train --init)"
        )
    try:
        x, y = load_server_arrays(Path(public_data), run.dataset.num_classes)
    except DataError as err:
        raise ExportError(f"--public-data {err}") from None
    if x.shape[1:] != run.dataset.x_train.shape[1:]:
        raise ExportError(
            f"--public-data {public_data}: inputs of shape {list(x.shape[1:])}, the run's are "
            f"{list(run.dataset.x_train.shape[1:])}"
        )
    return x, y


def old_release(old_export: Path) -> dict[str, Any]:
    """The model version record of an earlier export (its release record's, or, for an export
    from before versions, one naming its encoder only)."""
    encoder = old_export / "encoder.onnx"
    if not encoder.is_file():
        raise ExportError(f"--upgrade-from {old_export}: not an export directory (no encoder.onnx)")
    try:
        release = read_release(old_export)
    except ReleaseError:
        release = None
    if release is not None:
        return release.model.to_record()
    embedding = ModelVersion.of_encoder(encoder.read_bytes()).embedding
    return ModelVersion(embedding, old_export.name).to_record()
