"""Device capacity profiles: a memory budget for every client, read from a file or generated (one
budget for all, the paper's weak/strong split, a log-normal spread). Each is a `Budget` of its
total bytes; the exporter adds the encoder's share once it has built the encoder."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from edge_runtime._io import JSONFileError, read_json
from edge_runtime.budget import Budget
from edge_runtime.values import is_real
from export.errors import BudgetInvalid

PROFILES = ("uniform", "weak-strong", "lognormal")


def _check_bytes(value: object, what: str) -> int:
    """A budget is a positive whole number of bytes; floats like 1e6 are accepted if whole."""
    if not is_real(value):
        raise BudgetInvalid(f"{what} must be a number of bytes, got {value!r}")
    if not math.isfinite(float(value)) or float(value) != int(value) or int(value) < 1:
        raise BudgetInvalid(f"{what} must be a positive whole number of bytes, got {value!r}")
    return int(value)


def _check_clients(client_ids: Sequence[int]) -> list[int]:
    ids = [int(c) for c in client_ids]
    if not ids:
        raise BudgetInvalid("no clients to give budgets to")
    if len(set(ids)) != len(ids):
        raise BudgetInvalid("client ids must be distinct")
    return ids


MAX_BUDGET_FILE_BYTES = 16 << 20  # a line per client


def load_budgets(path: str | Path, client_ids: Sequence[int]) -> dict[int, Budget]:
    """Budgets from a JSON file {"<client id>": bytes, ...}. Every requested client must have one;
    entries for other clients are ignored only if they name real clients of the run, so that a
    typo never silently gives a device the wrong budget.

    Parameters
    ----------
    path : the JSON file (size bounded; BudgetInvalid says what is wrong with it).
    client_ids : the clients that need a budget.

    Returns
    -------
    dict : client id to its `Budget`, in the order of `client_ids`.
    """
    path = Path(path)
    ids = _check_clients(client_ids)
    try:
        raw = read_json(
            path, limit=MAX_BUDGET_FILE_BYTES, fix='write it as {"<client id>": bytes, ...}'
        )
    except FileNotFoundError:
        raise BudgetInvalid(f"budget file {path} does not exist") from None
    except JSONFileError as err:
        raise BudgetInvalid(f"budget file {err}") from None
    if not isinstance(raw, dict):
        raise BudgetInvalid(
            f"budget file {path} must hold an object {{client_id: bytes}}, got {type(raw).__name__}"
        )
    budgets: dict[int, Budget] = {}
    for key, value in raw.items():
        try:
            cid = int(key)
        except ValueError:
            raise BudgetInvalid(f"budget file {path}: key {key!r} is not a client id") from None
        if str(cid) != str(key).strip():
            raise BudgetInvalid(f"budget file {path}: key {key!r} is not a client id")
        budgets[cid] = Budget(_check_bytes(value, f"budget of client {cid} in {path}"))
    missing = [c for c in ids if c not in budgets]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise BudgetInvalid(f"budget file {path} has no budget for client(s) {shown}")
    return {c: budgets[c] for c in ids}


def uniform_budgets(client_ids: Sequence[int], budget: int) -> dict[int, Budget]:
    """The same budget of `budget` bytes for every client.

    Parameters
    ----------
    client_ids : the clients to give a budget to (distinct ids).
    budget : each device's total budget in bytes, encoder included (a positive integer).

    Returns
    -------
    dict : client id to its `Budget`.
    """
    value = Budget(_check_bytes(budget, "--budget"))
    return dict.fromkeys(_check_clients(client_ids), value)


def weak_strong_budgets(
    client_ids: Sequence[int], reference: int, delta_c: float, seed: int = 0
) -> dict[int, Budget]:
    """The paper's system heterogeneity: a seeded half of the clients ("weak") get
    (1/2 - delta_c) x reference and the others ("strong") (1/2 + delta_c) x reference.
    With an odd number of clients the extra one is strong.

    Parameters
    ----------
    client_ids : the clients to give a budget to (distinct ids).
    reference : the reference budget in bytes (the paper's C).
    delta_c : the paper's delta_C, in [0, 0.5): 0 gives every client half the reference.
    seed : chooses which half is weak.

    Returns
    -------
    dict : client id to its `Budget`.
    """
    ids = _check_clients(client_ids)
    reference = _check_bytes(reference, "--reference")
    if not isinstance(delta_c, (int, float)) or not 0 <= delta_c < 0.5:
        raise BudgetInvalid(f"--delta-c must be in [0, 0.5), got {delta_c!r}")
    weak = weak_clients(ids, seed)
    out = {}
    for cid in ids:
        share = 0.5 - delta_c if cid in weak else 0.5 + delta_c
        out[cid] = Budget(max(1, int(math.floor(share * reference))))
    return out


def weak_clients(client_ids: Sequence[int], seed: int = 0) -> set[int]:
    """The seeded half of the clients that weak_strong_budgets makes weak (the smaller half
    when the count is odd); experiments that split capacity the same way share the choice."""
    ids = list(client_ids)
    picked = np.random.default_rng(seed).permutation(len(ids))[: len(ids) // 2]
    return {ids[i] for i in picked.tolist()}


def lognormal_budgets(
    client_ids: Sequence[int], reference: int, sigma: float = 0.5, seed: int = 0
) -> dict[int, Budget]:
    """Budgets spread log-normally around `reference` (its median): reference x exp(sigma x N(0,1)).
    Device memory in the wild spans orders of magnitude; this models that spread.

    Parameters
    ----------
    client_ids : the clients to give a budget to (distinct ids).
    reference : the median budget in bytes.
    sigma : the spread, the standard deviation of the budgets' natural logarithm (>= 0;
        0 gives every client `reference`).
    seed : the draws' seed.

    Returns
    -------
    dict : client id to its `Budget` (at least 1 byte).
    """
    ids = _check_clients(client_ids)
    reference = _check_bytes(reference, "--reference")
    if not isinstance(sigma, (int, float)) or not math.isfinite(sigma) or sigma < 0:
        raise BudgetInvalid(
            f"--spread (the lognormal sigma) must be a finite number >= 0, got {sigma!r}"
        )
    draws = np.random.default_rng(seed).standard_normal(len(ids))
    return {
        cid: Budget(max(1, int(math.floor(reference * math.exp(sigma * float(e))))))
        for cid, e in zip(ids, draws, strict=True)
    }
