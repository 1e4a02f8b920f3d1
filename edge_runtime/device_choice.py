"""How a device chooses its datastore and lambda from its own embedded samples (steps 2 to 4
of edge_runtime.device_init): `knnper-edge init` builds a bundle by it, and `knnper-edge
upgrade` of a bundle that kept its raw inputs chooses again by it, so an upgrade gives exactly
what a fresh `init` would."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .datastores import BACKENDS, format_recipe, make_datastore, parse_recipe
from .knn import CLIENT_RULE, DEFAULT_K, DEFAULT_SIGMA, LambdaRule, datastore_key
from .personal_head import ClientSplits, PersonalHead

logger = logging.getLogger(__name__)


def with_inputs(recipe: str, nbytes: int) -> str:
    """The recipe keeping each sample's raw input of `nbytes` bytes (x<bytes>)."""
    name, params = parse_recipe(recipe)
    if BACKENDS[name].TRAINED:
        raise ValueError(
            f"a {name} datastore keeps what it was trained to, not samples: it "
            "cannot keep raw inputs"
        )
    return format_recipe(name, {**params, "inputs": int(nbytes)})


@dataclass(frozen=True)
class InitSettings:
    """How `init_bundle` chooses a new device's datastore and what its manifest records.

    Attributes
    ----------
    k, sigma : the kNN head's neighbours and kernel scale.
    recipes : candidate recipe strings (flat or hnsw; protonn needs server-side training);
        ones without n<count> get the budget's maximum and its halves, ones with n are tried
        as given if they fit. None: flat fp32, fp16 and int8.
    val_fraction : share of the samples held out (seeded) to choose the recipe and lambda,
        in [0, 1).
    seed : the seed of that split.
    client_id : the manifest's client id; -1 marks a device that never trained.
    update_strategy : the manifest's default for `Runtime.add`: "fifo", "concatenate" or
        "fixed".
    lambda_rule : how lambda is chosen from the validation split (a device on its own has no
        pooled evidence: its own split, the paper's rule; one given a server's pooled rule
        chooses as the server does).
    keep_inputs : the bundle also keeps every sample's raw input (counted in its budget), so
        that `knnper-edge upgrade` re-embeds them exactly when the model changes.
    intra_op_threads : onnxruntime's intra-op threads for the encoder; None lets it choose.
    """

    k: int = DEFAULT_K
    sigma: float = DEFAULT_SIGMA
    recipes: Sequence[str] | None = None
    val_fraction: float = 0.2
    seed: int = 0
    client_id: int = -1
    update_strategy: str = "fifo"
    lambda_rule: LambdaRule = CLIENT_RULE
    keep_inputs: bool = False
    intra_op_threads: int | None = None


def choose_datastore(
    z: np.ndarray,
    logits: np.ndarray,
    y: np.ndarray,
    recipes: list[str],
    settings: InitSettings,
    inputs: np.ndarray | None = None,
) -> tuple[Any, dict, list[dict]]:
    """Steps 2 to 4 of the module docstring on a device's embedded samples (z, logits, y;
    `inputs`: their raw inputs, where the recipes keep them): (the winning datastore fitted on
    every sample, its row, every candidate's row). `knnper-edge upgrade` of a bundle that kept
    its raw inputs chooses by the same code, so it gives what a fresh `init` would."""
    s, num_classes = settings, logits.shape[1]
    n_all = z.shape[0]
    order = np.random.default_rng(s.seed).permutation(n_all)
    n_val = int(round(s.val_fraction * n_all)) if n_all >= 2 else 0
    n_val = min(n_val, n_all - 1)
    val, train = order[:n_val], order[n_val:]
    splits = ClientSplits.from_logits(
        s.client_id, True, (z[train], logits[train], y[train]), (z[val], logits[val], y[val])
    )
    head = PersonalHead(num_classes, k=s.k, sigma=s.sigma, rule=s.lambda_rule)
    candidates = []
    for recipe in recipes:
        ds = make_datastore(recipe, num_classes, s.k, s.sigma, seed=s.seed)
        nbytes = ds.file_nbytes(min(ds.n or n_all, n_all), z.shape[1])  # as the exporter ranks
        kept = None if inputs is None else inputs[train]
        head.fit(splits, datastore=ds.fit(z[train], y[train], kept))
        candidates.append(
            {
                "recipe": recipe,
                "lambda": head.lambda_,
                "val_accuracy": head.val_accuracy_,
                "val_nll": head.val_nll_,
                "nbytes": nbytes,
            }
        )
        logger.info(
            "candidate %s: lambda %.1f, validation accuracy %s",
            recipe,
            head.lambda_,
            head.val_accuracy_,
        )
    # The exporter's ranking (edge_runtime.knn.datastore_key; flat and hnsw are not trained).
    # Without a validation split every candidate ties: the smallest footprint.
    best = min(
        candidates,
        key=lambda c: datastore_key(
            c["val_accuracy"], c["val_nll"], trained=False, nbytes=c["nbytes"]
        ),
    )
    final = make_datastore(best["recipe"], num_classes, s.k, s.sigma, seed=s.seed).fit(z, y, inputs)
    return final, best, candidates
