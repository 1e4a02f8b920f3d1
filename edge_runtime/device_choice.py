"""How a device chooses its datastore and lambda from its own embedded samples (steps 2 to 4
of edge_runtime.device_init): `knnper-edge init` builds a bundle by it, and `knnper-edge
upgrade` of a bundle that kept its raw inputs chooses again by it, so an upgrade gives exactly
what a fresh `init` would."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .datastores import BACKENDS, format_recipe, make_datastore, parse_recipe
from .knn import LambdaRule, datastore_key
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


def choose_datastore(
    z: np.ndarray,
    logits: np.ndarray,
    y: np.ndarray,
    recipes: list[str],
    *,
    k: int,
    sigma: float,
    val_fraction: float,
    seed: int,
    client_id: int,
    lambda_rule: LambdaRule,
    inputs: np.ndarray | None = None,
) -> tuple[Any, dict, list[dict]]:
    """Steps 2 to 4 of the module docstring on a device's embedded samples (z, logits, y;
    `inputs`: their raw inputs, where the recipes keep them): (the winning datastore fitted on
    every sample, its row, every candidate's row). `knnper-edge upgrade` of a bundle that kept
    its raw inputs chooses by the same code, so it gives what a fresh `init` would."""
    num_classes = logits.shape[1]
    n_all = z.shape[0]
    order = np.random.default_rng(seed).permutation(n_all)
    n_val = int(round(val_fraction * n_all)) if n_all >= 2 else 0
    n_val = min(n_val, n_all - 1)
    val, train = order[:n_val], order[n_val:]
    splits = ClientSplits.from_logits(
        client_id, True, (z[train], logits[train], y[train]), (z[val], logits[val], y[val])
    )
    head = PersonalHead(num_classes, k=k, sigma=sigma, rule=lambda_rule)
    candidates = []
    for recipe in recipes:
        ds = make_datastore(recipe, num_classes, k, sigma, seed=seed)
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
    final = make_datastore(best["recipe"], num_classes, k, sigma, seed=seed).fit(z, y, inputs)
    return final, best, candidates
