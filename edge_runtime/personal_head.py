"""A client's personal head: what turns the global model's outputs into that client's
prediction. Its parts are a kNN datastore over the client's own embeddings and, optionally, a
linear head on them as the base in place of the global model; lambda mixes the two and is chosen
on the client's validation split by the interpolation rule.

Every place that personalizes goes through `PersonalHead`: the server's kNN-Per, the
experiments, the exporter's sizer and reference, `knnper-edge init` and the runtime. So a rule,
a base or a datastore is one edit, and they all choose and predict alike on the same
embeddings. The math underneath (kernel posterior, interpolation, the rule's ranking) is
edge_runtime.knn's."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .knn import (
    CLIENT_RULE,
    DEFAULT_K,
    DEFAULT_NORMALIZE,
    DEFAULT_SIGMA,
    LAMBDA_ESTIMATORS,
    NORMALIZATIONS,
    KNNHead,
    LambdaRule,
    Posteriors,
    estimator_evidence,
    interpolate,
    k_sigma_problem,
    lambda_counts,
    leave_one_out_posteriors,
    normalize_embeddings,
    softmax,
    split_score,
)
from .linear_head import LinearHead

Split = tuple[np.ndarray, np.ndarray, np.ndarray]  # embeddings, logits, labels


@dataclass
class ClientSplits:
    """One client under one trained body, embedded once: its train split (what the datastore
    and the linear head are fitted on), its validation split (what every choice is judged on)
    and its test split (what is reported), each as embeddings, labels and the base model's
    class probabilities. The one per-client type of the server, the exporter, the experiments
    and the device (whose test split is empty).

    Parameters
    ----------
    client_id : the client's id in its run (-1 on a device that never trained).
    unseen : whether the client was held out of training.
    z_train, z_val, z_test : each split's embeddings, float [n, p].
    y_train, y_val, y_test : each split's integer labels [n].
    p_train, p_val, p_test : each split's base-model class probabilities [n, C].
    """

    client_id: int
    unseen: bool
    z_train: np.ndarray
    y_train: np.ndarray
    z_val: np.ndarray
    y_val: np.ndarray
    z_test: np.ndarray
    y_test: np.ndarray
    p_train: np.ndarray
    p_val: np.ndarray
    p_test: np.ndarray

    @property
    def num_classes(self) -> int:
        return int(self.p_train.shape[1] if self.p_train.ndim == 2 else self.p_val.shape[1])

    @property
    def n_train(self) -> int:
        return len(self.y_train)

    @classmethod
    def from_logits(
        cls,
        client_id: int,
        unseen: bool,
        train: Split,
        val: Split | None = None,
        test: Split | None = None,
    ) -> ClientSplits:
        """From (embeddings, logits, labels) of each split as an encoder gives them; a split
        not given is empty. The base probabilities are the global model's softmax."""
        z, logits, y = train
        width, dim = np.asarray(logits).shape[1], np.asarray(z).shape[1]
        empty: Split = (
            np.zeros((0, dim), np.float32),
            np.zeros((0, width), np.float32),
            np.zeros(0, np.int64),
        )
        parts = [_as_split(s if s is not None and len(s[2]) else empty) for s in (train, val, test)]
        return cls(
            client_id,
            unseen,
            parts[0][0],
            parts[0][2],
            parts[1][0],
            parts[1][2],
            parts[2][0],
            parts[2][2],
            *(softmax(p[1].astype(np.float64)) for p in parts),
        )


def _as_split(split: Split) -> Split:
    z, logits, y = split
    return (np.asarray(z, np.float32), np.asarray(logits), np.asarray(y, np.int64))


def check_settings(k: int, sigma: float, normalize: str, estimator: str, l2: float | None) -> None:
    """ValueError unless a head with these settings can run (server and device alike)."""
    problem = k_sigma_problem(k, sigma)
    if problem:
        raise ValueError(problem)
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {', '.join(NORMALIZATIONS)}, got {normalize!r}")
    if estimator not in LAMBDA_ESTIMATORS:
        raise ValueError(
            f"lambda estimator must be one of {', '.join(LAMBDA_ESTIMATORS)}, got {estimator!r}"
        )
    if l2 is not None and not l2 > 0:
        raise ValueError(f"a linear head's l2 must be positive, got {l2}")


class KNNPart(Protocol):
    """What the head needs of a kNN part: any fitted edge_runtime datastore, or KNNHead."""

    def predict_proba(self, z: np.ndarray) -> np.ndarray: ...


class PersonalHead:
    """lambda * kNN(z) + (1 - lambda) * base(z), per client. scikit-learn style: settings here;
    `fit` on a ClientSplits fits the parts and chooses lambda; results in `lambda_`,
    `datastore_`, `linear_` (None: the base is the global model), `evidence_` (the [grid, 3]
    validation sums lambda was chosen from) and `val_accuracy_` / `val_nll_` at `lambda_`
    (None without a validation split).

    Parameters
    ----------
    num_classes : the number of classes the labels range over.
    k, sigma : the kNN part's neighbours and kernel scale (`KNNHead`).
    normalize : "none" or "l2", applied to every embedding the head sees (keys and queries
        alike).
    l2 : fits a `LinearHead` with this penalty on the normalised train embeddings as the
        base; None: no linear head, the base is the global model's output the caller passes.
    rule : how lambda comes from the validation evidence (`LambdaRule`: the client's own, pooled
        or shrunk towards the pool).
    estimator : "val" (the validation split) or "loo+val" (leave-one-out on the train split
        as well).
    """

    def __init__(
        self,
        num_classes: int,
        *,
        k: int = DEFAULT_K,
        sigma: float = DEFAULT_SIGMA,
        normalize: str = DEFAULT_NORMALIZE,
        l2: float | None = None,
        rule: LambdaRule = CLIENT_RULE,
        estimator: str = "val",
    ) -> None:
        check_settings(k, sigma, normalize, estimator, l2)
        self.num_classes = num_classes
        self.k, self.sigma, self.normalize, self.l2 = k, sigma, normalize, l2
        self.rule, self.estimator = rule, estimator
        # no linear part until `fit` fits one: the base is then the output the caller passes
        # (the global model's, or a client encoder's own head on the exporter's side)
        self.linear_: LinearHead | None = None

    # -- fitting
    def fit(
        self,
        client: ClientSplits,
        *,
        keep: np.ndarray | None = None,
        datastore: KNNPart | None = None,
        loo: Posteriors | None = None,
    ) -> PersonalHead:
        """Fit the parts on `client`'s train split and choose lambda on its validation split.

        `keep`: the train samples the datastore stores (default all; the linear head always
        sees all). `datastore`: an already fitted kNN part to use instead (the exporter's and the
        device's budget-sized candidates), queried with embeddings as given. `loo`: the
        leave-one-out evidence of the "loo+val" estimator when the caller has it already (it
        is the same for every candidate datastore of a client)."""
        z_train = self._normalized(client.z_train)
        if len(z_train) == 0:
            raise ValueError(
                f"client {client.client_id} has no training samples to personalize with"
            )
        keep = np.arange(len(z_train)) if keep is None else np.asarray(keep)
        self.fit_linear(client.z_train, client.y_train)
        self.stored_ = len(keep) if datastore is None else _stored(datastore, len(keep))
        if datastore is None:
            datastore = KNNHead(self.num_classes, self.k, self.sigma).fit(
                z_train[keep], client.y_train[keep]
            )
        self.datastore_ = datastore
        if loo is None and self.estimator == "loo+val":
            loo = self.leave_one_out(client, keep)
        p_local, p_base = self._parts(client.z_val, client.p_val)
        self.choose(p_local, p_base, client.y_val, loo)
        self.val_accuracy_: float | None = None
        self.val_nll_: float | None = None
        if len(client.y_val):
            self.val_accuracy_, self.val_nll_ = split_score(self.mix(p_local, p_base), client.y_val)
        return self

    def choose(
        self, p_local: np.ndarray, p_base: np.ndarray, y: np.ndarray, loo: Posteriors | None = None
    ) -> PersonalHead:
        """Choose lambda by the rule and the estimator from the parts' outputs on labelled
        samples (`fit`'s last step; the tuning grid's, which computes the kNN part once for
        many settings, and the test oracle's, which the reports label optimistic). Sets
        `evidence_` and `lambda_`."""
        self.evidence_ = lambda_counts(
            *estimator_evidence(self.estimator, p_local, p_base, y, loo), self.rule.grid
        )
        self.lambda_ = self.rule.choose_from_counts(self.evidence_)
        return self

    def fit_linear(self, z_train: np.ndarray, y_train: np.ndarray) -> LinearHead | None:
        """The linear base alone (None without `l2`), fitted on the normalised train
        embeddings: `fit`'s, and the exporter's for the head it puts in a client's encoder."""
        self.linear_ = (
            None
            if self.l2 is None
            else LinearHead(self.num_classes, l2=self.l2).fit(self._normalized(z_train), y_train)
        )
        return self.linear_

    def leave_one_out(self, client: ClientSplits, keep: np.ndarray | None = None) -> Posteriors:
        """The "loo+val" estimator's extra evidence: each kept train sample's kNN posterior from
        the other kept samples (float keys), with the base's output and its label (a linear
        base's only once `fit` has fitted it, which it does first)."""
        keep = np.arange(client.n_train) if keep is None else np.asarray(keep)
        keys = self._normalized(client.z_train[keep])
        return (
            leave_one_out_posteriors(
                keys, client.y_train[keep], self.num_classes, self.k, self.sigma
            ),
            self.base_proba(client.z_train[keep], client.p_train[keep]),
            client.y_train[keep],
        )

    @classmethod
    def fitted(
        cls,
        num_classes: int,
        datastore: KNNPart,
        lam: float,
        *,
        linear: LinearHead | None = None,
        normalize: str = "none",
    ) -> PersonalHead:
        """A head from parts chosen elsewhere: a bundle's datastore and lambda on a device."""
        head = cls(num_classes, normalize=normalize)
        head.datastore_, head.linear_, head.lambda_ = datastore, linear, float(lam)
        head.stored_ = _stored(datastore, 0)
        head.val_accuracy_ = head.val_nll_ = None
        return head

    def with_lambda(self, lam: float) -> PersonalHead:
        """The same fitted parts mixed with another lambda (a fixed setting, the kNN alone)."""
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lambda must be in [0, 1], got {lam}")
        other = copy.copy(self)
        other.lambda_ = float(lam)
        return other

    # -- prediction
    def local_proba(self, z: np.ndarray) -> np.ndarray:
        """The kNN part's class probabilities."""
        return self.datastore_.predict_proba(self._normalized(z))

    def base_proba(self, z: np.ndarray, p_global: np.ndarray) -> np.ndarray:
        """The base's class probabilities: the global model's `p_global`, or the linear head's."""
        if self.linear_ is None:
            return p_global
        return self.linear_.predict_proba(self._normalized(z))

    def mix(self, p_local: np.ndarray, p_base: np.ndarray) -> np.ndarray:
        """The interpolation at `lambda_` of parts already computed."""
        return interpolate(p_local, p_base, self.lambda_)

    def predict_proba(self, z: np.ndarray, p_global: np.ndarray) -> np.ndarray:
        """[N, C] personalized probabilities from embeddings and the global model's output."""
        return self.mix(*self._parts(z, p_global))

    def predict(self, z: np.ndarray, p_global: np.ndarray) -> np.ndarray:
        return self.predict_proba(z, p_global).argmax(axis=1)

    def accuracy(self, z: np.ndarray, p_global: np.ndarray, y: np.ndarray) -> float | None:
        """Share of `y` predicted right; None on an empty split."""
        if len(y) == 0:
            return None
        return float(np.mean(self.predict(z, p_global) == np.asarray(y)))

    def _parts(self, z: np.ndarray, p_global: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if len(z) == 0:
            empty = np.zeros((0, self.num_classes))
            return empty, empty
        return self.local_proba(z), self.base_proba(z, p_global)

    def _normalized(self, z: np.ndarray) -> np.ndarray:
        return normalize_embeddings(z, self.normalize)


def _stored(datastore: Any, default: int) -> int:
    try:
        return len(datastore)
    except TypeError:
        return default
