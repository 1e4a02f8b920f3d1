"""The forms a key map may take and the cross-validation that picks one (export.upgrade_map).

Every form has a linear part z @ weight + bias; one adds a correction the device applies too
(edge_runtime.keymap):

- "ridge": ridge-regularised linear, the strength alpha;
- "ridge standardised": ridge on standardised old embeddings (each dimension's scale no longer
  sets its penalty), folded back into one linear map: still form "linear" on the device;
- "low-rank": reduced-rank regression, the ridge map projected on the top `rank` directions of
  its fitted values: form "linear" on the device;
- "per-class": the ridge map plus, for keys of class c, a ridge-fitted affine correction of its
  residual on that class's samples (a device knows its keys' labels): form "per-class".

A small MLP on the ridge map's residual was measured too and left out (benchmarks/map_forms.py):
no better by this criterion on either version gap, and 15 to 50 times slower to cross-validate
than all the forms kept together.

The criterion is what a device gets from the map rather than the mean squared error: on each
fold, the held-out samples' old embeddings are mapped and searched, each by its own new
embedding, leave-own-out, with the release's k and sigma (the device's kNN); the candidate of
the highest pooled accuracy wins, ties going to the lower cross-validated squared error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_runtime.knn import exact_search, kernel_posterior

RIDGE_ALPHAS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)
CV_FOLDS = 5
# low-rank: the rank as a fraction of the new embedding's width
RANK_FRACTIONS = (0.25, 0.5)
# per-class: the correction's ridge strength as a multiple of the linear part's
CLASS_STRENGTHS = (1.0, 10.0, 100.0)


@dataclass(frozen=True)
class Candidate:
    """One form at one strength (alpha is the linear part's ridge strength)."""

    form: str
    alpha: float
    size: float = 0.0  # rank fraction (low-rank), strength multiple (per-class)

    def name(self) -> str:
        extra = {
            "low-rank": f" rank {self.size:g}p",
            "per-class": f" class strength x{self.size:g}",
        }.get(self.form, "")
        return f"{self.form} alpha {self.alpha:g}{extra}"


@dataclass
class FittedMap:
    """A fitted map as the device applies it: the linear part and the form's extra arrays."""

    form: str  # the device's form: "linear" or "per-class"
    weight: np.ndarray
    bias: np.ndarray
    extra: dict[str, np.ndarray] = field(default_factory=dict)

    def apply(self, z: np.ndarray, labels: np.ndarray | None = None) -> np.ndarray:
        from edge_runtime.keymap import apply_map

        return apply_map(self.form, self.weight, self.bias, self.extra, z, labels)


def ridge(x: np.ndarray, y: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """(W, b) minimising ||x W + b - y||^2 + alpha n ||W||^2 (the intercept unpenalised)."""
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    mx, my = x64.mean(0), y64.mean(0)
    xc = x64 - mx
    gram = xc.T @ xc + alpha * len(x) * np.eye(x.shape[1])
    w = np.linalg.solve(gram, xc.T @ (y64 - my))
    return w.astype(np.float32), (my - mx @ w).astype(np.float32)


def _scale(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x64 = x.astype(np.float64)
    sd = x64.std(0)
    return x64.mean(0), np.where(sd > 1e-8, sd, 1.0)


def _standardised_ridge(x: np.ndarray, y: np.ndarray, alpha: float) -> tuple[np.ndarray, ...]:
    mx, sd = _scale(x)
    w, b = ridge((x - mx) / sd, y, alpha)
    w64 = w.astype(np.float64) / sd[:, None]
    return w64.astype(np.float32), (b - mx @ w64).astype(np.float32)


def _low_rank(x: np.ndarray, y: np.ndarray, alpha: float, fraction: float) -> tuple:
    w, b = ridge(x, y, alpha)
    x64 = x.astype(np.float64)
    fitted = (x64 - x64.mean(0)) @ w
    rank = max(1, int(round(fraction * y.shape[1])))
    v = np.linalg.svd(fitted, full_matrices=False)[2][:rank].T
    wr = w.astype(np.float64) @ v @ v.T
    return wr.astype(np.float32), (y.astype(np.float64).mean(0) - x64.mean(0) @ wr).astype(
        np.float32
    )


def _per_class(
    x: np.ndarray, y: np.ndarray, labels: np.ndarray, alpha: float, multiple: float, classes: int
) -> FittedMap:
    w, b = ridge(x, y, alpha)
    residual = y - (x @ w + b)
    cw = np.zeros((classes, *w.shape), np.float32)
    cb = np.zeros((classes, w.shape[1]), np.float32)
    for c in range(classes):
        rows = labels == c
        if rows.sum() >= 2:
            cw[c], cb[c] = ridge(x[rows], residual[rows], alpha * multiple)
    return FittedMap("per-class", w, b, {"class_weight": cw, "class_bias": cb})


def fit_candidate(
    c: Candidate, x: np.ndarray, y: np.ndarray, labels: np.ndarray, classes: int
) -> FittedMap:
    """Fit candidate `c` from old embeddings `x` to new ones `y` (labels for per-class)."""
    if c.form == "ridge":
        return FittedMap("linear", *ridge(x, y, c.alpha))
    if c.form == "ridge standardised":
        return FittedMap("linear", *_standardised_ridge(x, y, c.alpha))
    if c.form == "low-rank":
        return FittedMap("linear", *_low_rank(x, y, c.alpha, c.size))
    if c.form == "per-class":
        return _per_class(x, y, labels, c.alpha, c.size, classes)
    raise ValueError(f"unknown map form {c.form!r}")


def candidates(alpha: float, forms: tuple[str, ...]) -> list[Candidate]:
    """Every ridge strength, and the other forms around the ridge's best strength `alpha`."""
    out = [Candidate("ridge", a) for a in RIDGE_ALPHAS]
    if "ridge standardised" in forms:
        out += [Candidate("ridge standardised", a) for a in RIDGE_ALPHAS]
    if "low-rank" in forms:
        out += [Candidate("low-rank", alpha, f) for f in RANK_FRACTIONS]
    if "per-class" in forms:
        out += [Candidate("per-class", alpha, m) for m in CLASS_STRENGTHS]
    return out


def folds_of(n: int, seed: int, folds: int = CV_FOLDS) -> np.ndarray:
    return np.random.default_rng([seed, 0x3A9]).permutation(n) % folds


def leave_own_out_accuracy(
    keys: np.ndarray, queries: np.ndarray, labels: np.ndarray, classes: int, k: int, sigma: float
) -> np.ndarray:
    """Whether each query (the new embedding of sample i) is classified right by the kNN over
    the keys of the other samples (the device's kNN: flat, exact, k, sigma)."""
    n = len(labels)
    kk = min(k, n - 1)
    sq, idx = exact_search(queries, keys, kk + 1)
    own = idx == np.arange(n)[:, None]
    own[~own.any(axis=1), -1] = True
    sq, idx = sq[~own].reshape(n, kk), idx[~own].reshape(n, kk)
    p = kernel_posterior(sq, labels[idx], classes, sigma, keys.shape[1])
    return p.argmax(1) == labels


def cross_validate(
    cands: list[Candidate],
    x: np.ndarray,
    y: np.ndarray,
    labels: np.ndarray,
    classes: int,
    *,
    k: int,
    sigma: float,
    seed: int = 0,
    folds: int = CV_FOLDS,
    fit=fit_candidate,
) -> dict[Candidate, dict[str, float]]:
    """Each candidate's pooled leave-own-out kNN accuracy and mean squared error over folds
    (`fit`: how a candidate is fitted, fit_candidate's signature; benchmarks try others)."""
    fold = folds_of(len(x), seed, folds)
    scores: dict[Candidate, dict[str, Any]] = {c: {"hits": 0, "se": 0.0} for c in cands}
    for f in range(folds):
        train, test = fold != f, fold == f
        for c in cands:
            fitted = fit(c, x[train], y[train], labels[train], classes)
            mapped = fitted.apply(x[test], labels[test])
            scores[c]["hits"] += int(
                leave_own_out_accuracy(mapped, y[test], labels[test], classes, k, sigma).sum()
            )
            scores[c]["se"] += float(((mapped - y[test]) ** 2).sum())
    n, width = len(x), y.shape[1]
    return {
        c: {"knn_accuracy": s["hits"] / n, "mse": s["se"] / (n * width)} for c, s in scores.items()
    }


def best_alpha(scores: dict[Candidate, dict[str, float]]) -> float:
    """The plain ridge's best strength by the criterion (see choose)."""
    return choose({c: s for c, s in scores.items() if c.form == "ridge"}).alpha


def choose(scores: dict[Candidate, dict[str, float]]) -> Candidate:
    """The highest cross-validated kNN accuracy; ties to the lower squared error, then to the
    earlier (simpler) candidate."""
    order = list(scores)
    return min(order, key=lambda c: (-scores[c]["knn_accuracy"], scores[c]["mse"], order.index(c)))
