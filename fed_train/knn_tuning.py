"""kNN-Per's own hyper-parameters, chosen on validation: the number of neighbours k, the kernel
scale sigma and the embedding normalisation, plus two honest ways to pick each client's lambda
and what a test-oracle lambda would have gained (reported to size lambda's noise, never used).

k, sigma and the normalisation are chosen once per run on the pooled validation splits of the
clients seen in training, not per client: a client holds about 30 validation samples, too few to
choose among the 104 grid points without fitting noise, while lambda (7 values) stays per client
as the paper has it. Each grid point is scored with every client's lambda chosen for that point.

The kNN math is edge_runtime's (`exact_search`, `kernel_posterior`), and every lambda is chosen
and mixed by its `PersonalHead` (on kNN posteriors computed once per client at the largest k and
re-weighted per grid point), so what is chosen here is exactly what a device computes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol, TypeVar

import numpy as np

from edge_runtime.knn import (
    CLIENT_RULE,
    DEFAULT_NORMALIZE,
    KNN_BASES,
    LAMBDA_ESTIMATORS,
    LAMBDA_GRID,
    LAMBDA_RULES,
    NORMALIZATIONS,
    LambdaRule,
    choice_key,
    exact_search,
    kernel_posterior,
    leave_one_out_search,
    normalize_embeddings,
    softmax,
    split_sums,
)
from edge_runtime.linear_head import L2_GRID, LinearHead
from edge_runtime.personal_head import ClientSplits, PersonalHead
from fed_train.algorithms.base import ClientData, embed_and_logits
from fed_train.knn_request import K_GRID, SIGMA_GRID
from fed_train.knn_setting import KNNChoice, KNNConfig
from fed_train.models import EmbedHeadModel
from fed_train.progress import Progress

BaseProbs = Callable[[ClientData], tuple[np.ndarray, np.ndarray, np.ndarray]]


def client_views(
    model: EmbedHeadModel,
    clients: Sequence[ClientData],
    base_probs: BaseProbs | None = None,
    *,
    normalize: str = DEFAULT_NORMALIZE,
) -> list[ClientSplits]:
    """Embed every client's splits once with `model`'s body, normalised as kNN-Per's
    `normalize` says (keys and queries alike), for every sweep over them. Without `base_probs`
    the base predictor is the model's own head (the global model)."""
    views = []
    for c in clients:
        parts = [embed_and_logits(model, x) for x in (c.x_train, c.x_val, c.x_test)]
        if base_probs is None:
            probs = [
                softmax(logits.astype(np.float64))
                if len(logits)
                else np.zeros((0, model.classifier.out_features))
                for _, logits in parts
            ]
        else:
            probs = list(base_probs(c))
        views.append(
            ClientSplits(
                c.client_id,
                c.unseen,
                parts[0][0],
                c.y_train.cpu().numpy(),
                parts[1][0],
                c.y_val.cpu().numpy(),
                parts[2][0],
                c.y_test.cpu().numpy(),
                *probs,
            )
        )
    return normalized_views(views, normalize)


class _Searched:
    """A client's neighbours at the largest k of the grid, found once per normalisation for the
    splits asked for ("val", "test", and "train": leave-one-out over the datastore); every
    (k, sigma) point then only re-weights them. Choosing never asks for "test"."""

    def __init__(
        self, view: ClientSplits, normalize: str, k_max: int, splits: Sequence[str]
    ) -> None:
        self.view = view
        self.dim = view.z_train.shape[1]
        keys = normalize_embeddings(view.z_train, normalize)
        self.found: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for split in splits:
            if split == "train":
                self.found[split] = leave_one_out_search(keys, k_max)
            else:
                queries = normalize_embeddings(getattr(view, f"z_{split}"), normalize)
                self.found[split] = self._search(keys, queries, k_max)

    @staticmethod
    def _search(keys: np.ndarray, queries: np.ndarray, k: int):
        if len(queries) == 0 or len(keys) == 0:
            return np.zeros((len(queries), 0)), np.zeros((len(queries), 0), dtype=np.int64)
        return exact_search(queries, keys, k)

    def posterior(self, split: str, k: int, sigma: float) -> np.ndarray:
        sq, idx = self.found[split]
        n = sq.shape[0]
        if sq.shape[1] == 0:  # no stored neighbour: the kNN part says nothing
            return np.full((n, self.view.num_classes), 1.0 / self.view.num_classes)
        k = min(k, sq.shape[1])
        return kernel_posterior(
            sq[:, :k], self.view.y_train[idx[:, :k]], self.view.num_classes, sigma, self.dim
        )


def _head(
    num_classes: int,
    config: KNNConfig,
    estimator: str = "val",
    grid: Sequence[float] = LAMBDA_GRID,
    rule: LambdaRule = CLIENT_RULE,
) -> PersonalHead:
    """The head that chooses and mixes under this grid point, estimator and rule (the client
    rule over `grid`)."""
    if rule.name == "client":
        rule = LambdaRule(grid=tuple(grid))
    return KNNChoice(config, estimator, lambda_rule=rule).head(num_classes)


def _chosen(
    s: _Searched,
    config: KNNConfig,
    estimator: str,
    val_rows: np.ndarray | None = None,
    grid: Sequence[float] = LAMBDA_GRID,
    rule: LambdaRule = CLIENT_RULE,
) -> PersonalHead:
    """A client's head with lambda chosen under `estimator` and `rule`, on its whole
    validation split or the given rows."""
    v = s.view
    rows = np.arange(len(v.y_val)) if val_rows is None else val_rows
    loo = None
    if estimator == "loo+val":
        p_loo = (
            s.posterior("train", config.k, config.sigma) if s.found["train"][0].shape[1] else None
        )  # a one-sample datastore has none
        loo = (p_loo, v.p_train, v.y_train)
    return _head(v.num_classes, config, estimator, grid, rule).choose(
        s.posterior("val", config.k, config.sigma)[rows], v.p_val[rows], v.y_val[rows], loo
    )


def grid_points(
    ks: Sequence[int], sigmas: Sequence[float], normalizations: Sequence[str]
) -> list[KNNConfig]:
    """The grid in the order it is scored and reported (ties go to the first)."""
    if not ks or not sigmas or not normalizations:
        raise ValueError("the k, sigma and normalisation grids must not be empty")
    return [
        KNNConfig(int(k), float(sigma), how)
        for how in normalizations
        for k in ks
        for sigma in sigmas
    ]


def grid_counts(
    view: ClientSplits, points: Sequence[KNNConfig], lambdas: Sequence[float] = LAMBDA_GRID
) -> np.ndarray:
    """One client's share of the grid's score, [points, 3]: validation samples right, summed
    log-loss and samples, each point with the client's own lambda chosen on its validation
    split. Clients compute it on their own data (a Flower evaluation sends only these sums),
    the server pools it."""
    searched: dict[str, _Searched] = {}
    out = np.zeros((len(points), 3))
    k_max = max(c.k for c in points)
    for i, config in enumerate(points):
        if config.normalize not in searched:
            searched[config.normalize] = _Searched(view, config.normalize, k_max, ("val",))
        s = searched[config.normalize]
        head = _chosen(s, config, "val", grid=lambdas)
        p = head.mix(s.posterior("val", config.k, config.sigma), view.p_val)
        c, nll = split_sums(p, view.y_val)
        out[i] = (c, nll, len(view.y_val))
    return out


class GridPoint(Protocol):
    """A point of any grid chosen on pooled validation (kNN-Per's, the linear head's)."""

    def to_dict(self) -> dict[str, Any]: ...


Point = TypeVar("Point", bound=GridPoint)


def pick_config(points: Sequence[Point], counts: Sequence[np.ndarray]) -> tuple[Point, list[dict]]:
    """The point with the best pooled validation score (edge_runtime.knn.choice_key) from the
    clients' per-point counts (right, summed log-loss, samples; e.g. grid_counts), pooled in
    the order given (callers sort by client id, so the sums are the same wherever they are
    made); returns it and every point's scores. Ties go to the first point."""
    if not counts:
        raise ValueError(
            "no seen client has both train and validation data: cannot choose on validation"
        )
    pooled = np.zeros((len(points), 3))
    for c in counts:
        pooled += c
    scores = [
        {**config.to_dict(), "val_accuracy": float(correct / total), "val_nll": float(nll / total)}
        for config, (correct, nll, total) in zip(points, pooled, strict=True)
    ]
    best = min(
        range(len(points)),
        key=lambda i: choice_key(scores[i]["val_accuracy"], scores[i]["val_nll"]),
    )
    return points[best], scores


def choosing_views(views: Sequence[ClientSplits]) -> list[ClientSplits]:
    """The clients a choice is made on: seen in training, with train and validation data."""
    return [v for v in views if not v.unseen and len(v.y_val) and len(v.y_train)]


def select_config(
    views: Sequence[ClientSplits],
    *,
    ks: Sequence[int] = K_GRID,
    sigmas: Sequence[float] = SIGMA_GRID,
    normalizations: Sequence[str] = NORMALIZATIONS,
    lambdas: Sequence[float] = LAMBDA_GRID,
) -> tuple[KNNConfig, list[dict]]:
    """The grid point with the best pooled validation accuracy of the seen clients (each with
    its own lambda chosen on its validation split for that point); ties go to the lower
    validation log-loss. Returns it and every point's scores. `lambdas=(1.0,)` scores the kNN
    alone."""
    points = grid_points(ks, sigmas, normalizations)
    return pick_config(points, [grid_counts(v, points, lambdas) for v in choosing_views(views)])


def estimator_counts(
    view: ClientSplits,
    config: KNNConfig,
    *,
    seed: int = 0,
    estimators: Sequence[str] = LAMBDA_ESTIMATORS,
) -> np.ndarray:
    """One client's two-fold cross-validation inside its validation split: [estimators, 2],
    samples right and samples scored, lambda chosen by each estimator on one half (plus the
    datastore for "loo+val") and scored on the other. The folds are seeded by (seed, client),
    so a client draws the same ones wherever it computes them. Zeros for a client with fewer
    than two validation or train samples."""
    out = np.zeros((len(estimators), 2))
    if view.unseen or len(view.y_val) < 2 or len(view.y_train) < 2:
        return out
    s = _Searched(view, config.normalize, config.k, ("val", "train"))
    folds = _folds(view, seed)
    p_knn_val = s.posterior("val", config.k, config.sigma)
    for fit, score in (folds, folds[::-1]):
        for i, est in enumerate(estimators):
            p = _chosen(s, config, est, val_rows=fit).mix(p_knn_val[score], view.p_val[score])
            out[i] += (int(np.sum(p.argmax(axis=1) == view.y_val[score])), len(score))
    return out


def pool_estimators(
    counts: Sequence[np.ndarray], estimators: Sequence[str] = LAMBDA_ESTIMATORS
) -> dict[str, float]:
    """Pooled cross-validated accuracy per estimator from the clients' estimator_counts."""
    pooled = np.zeros((len(estimators), 2))
    for c in counts:
        pooled += c
    if pooled[0, 1] == 0:
        raise ValueError("no seen client has enough validation data to compare estimators")
    return {est: float(pooled[i, 0] / pooled[i, 1]) for i, est in enumerate(estimators)}


def compare_lambda_estimators(
    views: Sequence[ClientSplits],
    config: KNNConfig,
    *,
    seed: int = 0,
    estimators: Sequence[str] = LAMBDA_ESTIMATORS,
) -> dict[str, float]:
    """Two-fold cross-validation inside each seen client's validation split (estimator_counts),
    pooled: which estimator to trust, decided without test data."""
    return pool_estimators(
        [estimator_counts(v, config, seed=seed, estimators=estimators) for v in views], estimators
    )


def pick_estimator(cv_scores: dict[str, float]) -> str:
    """The estimator with the best cross-validated accuracy; a tie keeps plain "val"."""
    return max(cv_scores, key=lambda e: (cv_scores[e], e == "val"))


def _splits_for(estimator: str, *extra: str) -> tuple[str, ...]:
    return ("val", *extra, "train") if estimator == "loo+val" else ("val", *extra)


def _folds(view: ClientSplits, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A client's two validation halves, seeded by (seed, client): the same wherever drawn."""
    order = np.random.default_rng([seed, view.client_id]).permutation(len(view.y_val))
    return order[: len(order) // 2], order[len(order) // 2 :]


def rule_evidence(view: ClientSplits, config: KNNConfig, estimator: str) -> np.ndarray:
    """One client's share of the pooled lambda evidence: `lambda_counts` ([grid, 3]) on the
    samples `estimator` judges on. A federated client sends only these sums."""
    if len(view.y_train) == 0:
        return np.zeros((len(LAMBDA_GRID), 3))
    s = _Searched(view, config.normalize, config.k, _splits_for(estimator))
    return _chosen(s, config, estimator).evidence_


def rule_fold_counts(
    view: ClientSplits, config: KNNConfig, estimator: str, *, seed: int = 0
) -> np.ndarray:
    """One client's two-fold material for comparing lambda rules, [2 * grid, 5], fold-major
    rows, one per (fold, lambda): the evidence of its fitting half (samples right, summed
    log-loss, samples) and the samples right and scored on its other half at that lambda.
    Zeros for a client with fewer than two validation or train samples."""
    grid = len(LAMBDA_GRID)
    out = np.zeros((2 * grid, 5))
    if view.unseen or len(view.y_val) < 2 or len(view.y_train) < 2:
        return out
    s = _Searched(view, config.normalize, config.k, _splits_for(estimator))
    p_knn_val = s.posterior("val", config.k, config.sigma)
    folds = _folds(view, seed)
    for f, (fit_rows, score_rows) in enumerate((folds, folds[::-1])):
        rows = slice(f * grid, (f + 1) * grid)
        out[rows, :3] = _chosen(s, config, estimator, fit_rows).evidence_
        scored = _head(view.num_classes, config).choose(
            p_knn_val[score_rows], view.p_val[score_rows], view.y_val[score_rows]
        )
        out[rows, 3:] = scored.evidence_[:, [0, 2]]
    return out


def _prior_samples(evidence: Sequence[np.ndarray]) -> float:
    """The shrunk rule's prior weight: the mean evidence size of the clients that have any, so
    a client of typical size weighs its own evidence and the pooled one equally."""
    sizes = [e[0, 2] for e in evidence if e[0, 2] > 0]
    return float(np.mean(sizes)) if sizes else 0.0


def fit_rule(name: str, evidence: Sequence[np.ndarray]) -> LambdaRule:
    """The rule `name` with the pooled evidence of the clients' `rule_evidence` (summed in the
    order given: callers sort by client id)."""
    if name == "client":
        return CLIENT_RULE
    pooled = np.zeros((len(LAMBDA_GRID), 3))
    for e in evidence:
        pooled += e
    if pooled[0, 2] == 0:
        raise ValueError(f"the {name} lambda rule needs validation evidence from seen clients")
    return LambdaRule(name, tuple(map(tuple, pooled.tolist())), _prior_samples(evidence))


def pool_rules(
    folds: Sequence[np.ndarray], rules: Sequence[str] = LAMBDA_RULES
) -> dict[str, float]:
    """Cross-validated accuracy of each rule from the clients' `rule_fold_counts`: in each fold,
    the pooled rules are fitted on every client's fitting half only, and each client's lambda
    is scored on its other half."""
    grid = len(LAMBDA_GRID)
    right, total = dict.fromkeys(rules, 0.0), 0.0
    for f in range(2):
        parts = [c[f * grid : (f + 1) * grid] for c in folds]
        if not any(part[0, 2] for part in parts):
            continue
        fitted = {name: fit_rule(name, [part[:, :3] for part in parts]) for name in rules}
        for part in parts:
            if part[0, 4] == 0:
                continue
            total += part[0, 4]
            for name, rule in fitted.items():
                right[name] += part[LAMBDA_GRID.index(rule.choose_from_counts(part[:, :3])), 3]
    if total == 0:
        raise ValueError("no seen client has enough validation data to compare lambda rules")
    return {name: float(right[name] / total) for name in rules}


CROSS_ORACLE_HALVINGS = 20


def cross_oracle_accuracy(
    p_knn: np.ndarray,
    p_global: np.ndarray,
    y: np.ndarray,
    *,
    seed: int,
    halvings: int = CROSS_ORACLE_HALVINGS,
) -> float:
    """What choosing lambda on test data is worth once the choice is not scored on the samples
    that made it: lambda chosen on one half of the test split, scored on the other (both ways),
    averaged over `halvings` seeded halvings."""
    head = _head(p_knn.shape[1], KNNConfig())
    if len(y) < 2:
        return (
            float(np.mean(head.choose(p_knn, p_global, y).mix(p_knn, p_global).argmax(1) == y))
            if len(y)
            else float("nan")
        )
    rng = np.random.default_rng(seed)
    accs = []
    for _ in range(halvings):
        order = rng.permutation(len(y))
        halves = (order[: len(y) // 2], order[len(y) // 2 :])
        right = 0
        for a, b in (halves, halves[::-1]):
            head.choose(p_knn[a], p_global[a], y[a])
            right += int(np.sum(head.mix(p_knn[b], p_global[b]).argmax(1) == y[b]))
        accs.append(right / len(y))
    return float(np.mean(accs))


def client_rows(
    views: Sequence[ClientSplits],
    config: KNNConfig,
    *,
    estimator: str = "val",
    lambdas: Sequence[float] = LAMBDA_GRID,
    rule: LambdaRule = CLIENT_RULE,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One row per client: test accuracy with the honestly chosen lambda, and, for the report
    only, the lambda that the client's test labels would have chosen (the official code's
    choice, optimistic by construction: it is scored on the samples that chose it), the accuracy
    it gives, and the split-half cross-oracle beside it. Nothing here feeds back into any
    choice."""
    rows = []
    for v in views:
        n_test = len(v.y_test)
        if len(v.y_train) == 0:
            head = _head(v.num_classes, config).with_lambda(0.0)
            p_knn = None
        else:
            s = _Searched(v, config.normalize, config.k, _splits_for(estimator, "test"))
            head = _chosen(s, config, estimator, grid=lambdas, rule=rule)
            p_knn = s.posterior("test", config.k, config.sigma)
        lam = head.lambda_
        if n_test == 0:
            rows.append(
                {
                    "client_id": v.client_id,
                    "unseen": v.unseen,
                    "n_test": 0,
                    "accuracy": None,
                    "info": {"lambda": lam},
                }
            )
            continue
        if p_knn is None:
            p_knn = np.full_like(v.p_test, 1.0 / v.num_classes)
        # optimistic by construction: chosen on the samples it is scored on
        oracle_head = _head(v.num_classes, config, grid=lambdas).choose(p_knn, v.p_test, v.y_test)
        oracle = oracle_head.lambda_
        acc = float(np.mean(head.mix(p_knn, v.p_test).argmax(1) == v.y_test))
        oracle_acc = float(np.mean(oracle_head.mix(p_knn, v.p_test).argmax(1) == v.y_test))
        cross = cross_oracle_accuracy(p_knn, v.p_test, v.y_test, seed=seed + v.client_id)
        rows.append(
            {
                "client_id": v.client_id,
                "unseen": v.unseen,
                "n_test": n_test,
                "accuracy": acc,
                "info": {
                    "lambda": lam,
                    "oracle_lambda": oracle,
                    "oracle_accuracy": oracle_acc,
                    "cross_oracle_accuracy": cross,
                },
            }
        )
    return rows


def base_probs_of(personalize: Callable[[ClientData], Any]) -> BaseProbs:
    """A body's own personalized predictor as the base that kNN-Per interpolates with."""

    def probs(client: ClientData) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        personal = personalize(client)
        return tuple(
            np.asarray(personal.predict_proba(x), dtype=np.float64)  # type: ignore
            for x in (client.x_train, client.x_val, client.x_test)
        )

    return probs


def lambda_report(rows: Sequence[dict[str, Any]]) -> dict[str, float | int]:
    """How often the honest lambda differs from the test oracle's and what that costs (pp of the
    test-size-weighted mean accuracy), over the clients with test data."""
    scored = [r for r in rows if r["accuracy"] is not None and "oracle_lambda" in r["info"]]
    if not scored:
        return {"clients": 0}
    w = np.array([r["n_test"] for r in scored], dtype=np.float64)
    honest = np.array([r["accuracy"] for r in scored])
    oracle = np.array([r["info"]["oracle_accuracy"] for r in scored])
    cross = np.array([r["info"]["cross_oracle_accuracy"] for r in scored])
    differs = [r["info"]["lambda"] != r["info"]["oracle_lambda"] for r in scored]
    return {
        "clients": len(scored),
        "differs": int(sum(differs)),
        "differs_fraction": float(np.mean(differs)),
        "honest_mean": float(np.average(honest, weights=w)),
        "oracle_mean": float(np.average(oracle, weights=w)),
        "cross_oracle_mean": float(np.average(cross, weights=w)),
        "cost_pp": float(100 * (np.average(oracle, weights=w) - np.average(honest, weights=w))),
    }


@dataclass(frozen=True)
class LinearConfig:
    """One point of the linear head's grid."""

    l2: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def l2_counts(view: ClientSplits, grid: Sequence[float] = L2_GRID) -> np.ndarray:
    """One client's share of the choice, [grid, 3]: for a head fitted on its train split with
    each l2, validation samples right, summed log-loss and samples."""
    out = np.zeros((len(grid), 3))
    n = len(view.y_val)
    if n == 0 or len(view.y_train) == 0:  # nothing to fit or to judge by
        return out
    for i, l2 in enumerate(grid):
        head = LinearHead(view.num_classes, l2=l2).fit(view.z_train, view.y_train)
        correct, nll = split_sums(head.predict_proba(view.z_val), view.y_val)
        out[i] = (correct, nll, n)
    return out


def choose_l2(
    views: Sequence[ClientSplits], grid: Sequence[float] = L2_GRID
) -> tuple[float, dict[str, Any]]:
    """The l2 whose heads score best on the seen clients' pooled validation splits (ties: the
    stronger regularisation, first in the grid), and the record of the choice: every grid
    value's scores and which clients and samples it was made on."""
    seen = choosing_views(views)
    config, scores = pick_config(
        [LinearConfig(float(l2)) for l2 in grid], [l2_counts(v, grid) for v in seen]
    )
    return config.l2, {
        "config": config.to_dict(),
        "grid": scores,
        "chosen_on": {
            "splits": "validation splits of the seen clients, pooled",
            "clients": [v.client_id for v in seen],
            "samples": int(sum(len(v.y_val) for v in seen)),
        },
    }


BASES: tuple[str, ...] = KNN_BASES


def normalized_views(views: Sequence[ClientSplits], normalize: str) -> list[ClientSplits]:
    """The same clients with their embeddings normalised as the kNN's are: what the exported
    encoder's "embedding" output gives the device, and so what a linear head there reads."""
    if normalize == "none":
        return list(views)
    return [
        replace(
            v,
            z_train=normalize_embeddings(v.z_train, normalize),
            z_val=normalize_embeddings(v.z_val, normalize),
            z_test=normalize_embeddings(v.z_test, normalize),
        )
        for v in views
    ]


def linear_base_views(
    views: Sequence[ClientSplits], l2: float, normalize: str = "none"
) -> list[ClientSplits]:
    """The same clients with the global model's probabilities replaced by each client's linear
    head (fitted with `l2` on its train embeddings, normalised as the kNN's: the encoder's
    "embedding" output on the device): the base kNN-Per interpolates with when the linear base
    is chosen. A client without train data keeps the global model."""
    out = []
    for v, n in zip(views, normalized_views(views, normalize), strict=True):
        if len(v.y_train) == 0:
            out.append(v)
            continue
        head = LinearHead(v.num_classes, l2=l2).fit(n.z_train, n.y_train)
        probs = [
            head.predict_proba(z) if len(z) else np.zeros((0, v.num_classes))
            for z in (n.z_train, n.z_val, n.z_test)
        ]
        out.append(replace(v, p_train=probs[0], p_val=probs[1], p_test=probs[2]))
    return out


def pick_base_and_rule(cv: dict[str, dict[str, float]]) -> tuple[str, str]:
    """The (base, rule) pair with the best cross-validated accuracy; ties go to the earlier
    base of BASES, then the earlier rule of LAMBDA_RULES (the paper's setting first)."""
    pairs = [(b, r) for b in cv for r in cv[b]]
    return max(
        pairs, key=lambda br: (cv[br[0]][br[1]], -BASES.index(br[0]), -LAMBDA_RULES.index(br[1]))
    )


def choose_knn(
    model: EmbedHeadModel,
    clients: Sequence[ClientData],
    *,
    ks: Sequence[int] = K_GRID,
    sigmas: Sequence[float] = SIGMA_GRID,
    normalizations: Sequence[str] = NORMALIZATIONS,
    estimator: str = "auto",
    rule: str = "client",
    base: str = "global",
    seed: int = 0,
    progress: bool = False,
) -> tuple[KNNConfig, str, dict[str, Any]]:
    """kNN-Per's configuration on a trained global model: the grid point (k, sigma,
    normalisation) with the best pooled validation score of the seen clients (a one-point grid
    is the fixed setting), the lambda estimator, the lambda rule and the base the kNN is
    interpolated with (the global model, or each client's linear head on the same embeddings),
    each by cross-validation inside the validation splits when asked for as "auto". Returns the
    configuration, the estimator and a record of the choice (the fitted rule under
    "lambda_rule", the base and its l2 under "base"), with each client's honest, test-oracle
    and cross-oracle accuracy (for the report; nothing chosen depends on test labels).
    `progress`: say each step as it starts (minutes on a large federation: a bar on a
    terminal, a line every 30 s in a log)."""
    bases = BASES if base == "auto" else (base,)
    rules = LAMBDA_RULES if rule == "auto" else (rule,)
    # embedding, the grid, the estimators, [the linear heads], [rule and base], the report
    total = 4 + ("linear" in bases) + (len(bases) * len(rules) > 1)
    with Progress(
        total, desc="choosing kNN-Per's configuration", unit="step", enabled=progress
    ) as steps:
        return _choose_knn(
            model, clients, ks, sigmas, normalizations, estimator, rule, base, seed, steps
        )


def _grid_and_estimators(
    views: Sequence[ClientSplits],
    ks: Sequence[int],
    sigmas: Sequence[float],
    normalizations: Sequence[str],
    seed: int,
    steps: Progress,
) -> tuple[KNNConfig, list[dict], dict[str, float]]:
    """The grid's best point on the seen clients' validation splits, its scores, and the lambda
    estimators' 2-fold cross-validation at that point (two steps of `steps`)."""
    points = len(ks) * len(sigmas) * len(normalizations)
    steps.set_postfix(
        f"k, sigma and normalisation: {points} grid points on {len(choosing_views(views))} "
        "clients' validation splits"
    )
    config, scores = select_config(views, ks=ks, sigmas=sigmas, normalizations=normalizations)
    steps.update()
    steps.set_postfix("the lambda estimators, 2-fold cross-validation")
    cv = compare_lambda_estimators(views, config, seed=seed)
    steps.update()
    return config, scores, cv


def _base_and_rule(
    base_views: dict[str, Sequence[ClientSplits]],
    rules: Sequence[str],
    config: KNNConfig,
    estimator: str,
    seed: int,
    steps: Progress,
) -> tuple[str, str, dict[str, dict[str, float]]]:
    """The base and lambda rule by 2-fold cross-validation where more than one pair is asked
    (one step of `steps`), with each base's pooled scores ({} when there was nothing to pick)."""
    if len(base_views) * len(rules) == 1:
        return next(iter(base_views)), rules[0], {}
    steps.set_postfix("the lambda rule and the base, 2-fold cross-validation")
    base_cv = {
        b: pool_rules([rule_fold_counts(v, config, estimator, seed=seed) for v in views], rules)
        for b, views in base_views.items()
    }
    steps.update()
    return *pick_base_and_rule(base_cv), base_cv


def _choose_knn(
    model: EmbedHeadModel,
    clients: Sequence[ClientData],
    ks: Sequence[int],
    sigmas: Sequence[float],
    normalizations: Sequence[str],
    estimator: str,
    rule: str,
    base: str,
    seed: int,
    steps: Progress,
) -> tuple[KNNConfig, str, dict[str, Any]]:
    steps.set_postfix("embedding every client's splits")
    views = client_views(model, clients)
    steps.update()
    seen = choosing_views(views)
    if (
        not seen
        and len(ks) == len(sigmas) == len(normalizations) == 1
        and estimator != "auto"
        and rule in ("client", "auto")
        and base in ("global", "auto")
    ):
        # a fixed setting needs no validation data to be chosen
        config, scores, cv = KNNConfig(int(ks[0]), float(sigmas[0]), normalizations[0]), [], {}
        rule, base = "client", "global"
        for _ in range(steps.total - 2):  # all but the embedding and the report: nothing to do
            steps.update(measured=False)
    else:
        config, scores, cv = _grid_and_estimators(views, ks, sigmas, normalizations, seed, steps)
    chosen = pick_estimator(cv) if estimator == "auto" else estimator
    bases = BASES if base == "auto" else (base,)
    base_views = {"global": views}
    l2_record: dict[str, Any] = {}
    if "linear" in bases:
        steps.set_postfix("the clients' linear heads: l2 on validation")
        l2, l2_record = choose_l2(normalized_views(views, config.normalize))
        base_views["linear"] = linear_base_views(views, l2, config.normalize)
        steps.update()
    rules = LAMBDA_RULES if rule == "auto" else (rule,)
    asked = {b: base_views[b] for b in bases}
    base, rule, base_cv = _base_and_rule(asked, rules, config, chosen, seed, steps)
    views = base_views[base]
    seen = choosing_views(views)
    steps.set_postfix("each client's lambda and the report")
    fitted = fit_rule(rule, [rule_evidence(v, config, chosen) for v in seen])
    oracle = client_rows(views, config, estimator=chosen, rule=fitted, seed=seed)
    steps.update()
    record = {
        "config": config.to_dict(),
        "grid": scores,
        "lambda_cv": cv,
        "estimator": chosen,
        "lambda_rule": fitted.to_dict(),
        "lambda_rule_cv": base_cv.get(base, {}),
        "base": {
            "name": base,
            "l2": l2_record["config"]["l2"] if base == "linear" else None,
            "l2_choice": l2_record,
        },
        "base_cv": base_cv,
        "chosen_on": {
            "splits": "validation splits of the seen clients, pooled",
            "clients": [v.client_id for v in seen],
            "samples": int(sum(len(v.y_val) for v in seen)),
        },
        "lambda_report": lambda_report(oracle),
        "oracle_rows": oracle,
    }
    return config, chosen, record
