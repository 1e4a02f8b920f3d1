"""Split a data set among federated clients (Dirichlet, pachinko, pathological, natural)."""

from __future__ import annotations

import bisect
import math
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_runtime._io import load_arrays, memory_limit, save_npz_atomic
from edge_runtime.values import is_integer, is_real
from fed_train.data import Dataset
from fed_train.errors import PartitionError

__all__ = ["SCHEMES", "ClientSplit", "Partition", "make_partition"]

_FORMAT = "knnper-partition"
_VERSION = 1
_PARTS = ("train", "val", "test")
_MAX_DRAWS = 1000  # Dirichlet re-draws before giving up on "every client has enough samples"


def _index_array(values: object, what: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise PartitionError(f"{what} must be a 1-D integer array, got {array.dtype} {array.shape}")
    if array.size and array.min() < 0:
        raise PartitionError(f"{what} holds a negative index")
    return array.astype(np.int64)


@dataclass(repr=False)
class ClientSplit:
    """One client's samples: train and val index x_train, test indexes x_test."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray

    def __post_init__(self) -> None:
        for part in _PARTS:
            setattr(self, part, _index_array(getattr(self, part), f"client {part} indices"))

    def __repr__(self) -> str:
        return f"ClientSplit(train={len(self.train)}, val={len(self.val)}, test={len(self.test)})"


@dataclass(repr=False)
class Partition:
    """Every client's split plus which clients are held out ("unseen": they never train).

    Parameters
    ----------
    clients : each client's train, val and test indices (`ClientSplit`).
    unseen : one flag per client, True for a held-out one.
    """

    clients: list[ClientSplit]
    unseen: np.ndarray

    def __post_init__(self) -> None:
        self.unseen = np.asarray(self.unseen, dtype=bool).reshape(-1)
        if len(self.unseen) != len(self.clients):
            raise PartitionError(
                f"unseen has {len(self.unseen)} flags for {len(self.clients)} clients"
            )

    def __repr__(self) -> str:
        return f"Partition({self.num_clients} clients, {int(self.unseen.sum())} unseen)"

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def summary(self) -> list[dict]:
        """Per-client sizes, one dict per client (ready for a CSV writer or a log line)."""
        return [
            {
                "client": i,
                "train": len(c.train),
                "val": len(c.val),
                "test": len(c.test),
                "unseen": bool(self.unseen[i]),
            }
            for i, c in enumerate(self.clients)
        ]

    def check(self, dataset: Dataset) -> None:
        """Refuse a partition whose indices do not fit `dataset` (e.g. made for other data)."""
        limits = {"train": len(dataset.y_train), "val": len(dataset.y_train)}
        limits["test"] = len(dataset.y_test)
        for i, client in enumerate(self.clients):
            for part, limit in limits.items():
                idx = getattr(client, part)
                if idx.size and idx.max() >= limit:
                    raise PartitionError(
                        f"client {i} {part} index {idx.max()} is out of range for dataset "
                        f"{dataset.name!r} ({limit} samples); was it made for other data?"
                    )

    def save(self, path: str | Path) -> None:
        """Write an npz (no pickle): per part, all clients' indices concatenated plus offsets."""
        path = Path(path)
        arrays: dict[str, np.ndarray] = {
            "format": np.array(_FORMAT),
            "version": np.array(_VERSION),
            "unseen": self.unseen,
        }
        for part in _PARTS:
            pieces = [getattr(c, part) for c in self.clients]
            sizes = np.array([len(p) for p in pieces], dtype=np.int64)
            arrays[f"{part}_offsets"] = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            arrays[f"{part}_index"] = (
                np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, np.int64)
            )
        save_npz_atomic(path, arrays)

    @classmethod
    def load(cls, path: str | Path) -> Partition:
        """Read a file written by save(), checking its structure before trusting it."""
        path = Path(path)
        if not path.is_file():
            raise PartitionError(f"partition file {path} does not exist")
        try:
            with load_arrays(path, memory_limit(), "indices") as archive:
                arrays = {key: archive[key] for key in archive.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
            raise PartitionError(f"{path}: not a partition file ({exc})") from exc
        needed = ["format", "version", "unseen"]
        needed += [f"{p}_{k}" for p in _PARTS for k in ("index", "offsets")]
        missing = [key for key in needed if key not in arrays]
        if missing:
            raise PartitionError(f"{path}: not a partition file (missing {', '.join(missing)})")
        version = arrays["version"]
        if (
            str(arrays["format"]) != _FORMAT
            or version.shape != ()
            or not np.issubdtype(version.dtype, np.integer)
            or int(version) != _VERSION
        ):
            raise PartitionError(
                f"{path}: format {arrays['format']} version {version}, "
                f"expected {_FORMAT} version {_VERSION}"
            )
        if arrays["unseen"].ndim != 1 or arrays["unseen"].dtype != bool:
            raise PartitionError(f"{path}: unseen must be a 1-D boolean array")
        num_clients = len(arrays["unseen"])
        parts: dict[str, list[np.ndarray]] = {}
        for part in _PARTS:
            index = _index_array(arrays[f"{part}_index"], f"{path}: {part}_index")
            offsets = _index_array(arrays[f"{part}_offsets"], f"{path}: {part}_offsets")
            if (
                len(offsets) != num_clients + 1
                or offsets[0] != 0
                or offsets[-1] != len(index)
                or np.any(np.diff(offsets) < 0)
            ):
                raise PartitionError(f"{path}: corrupt {part}_offsets for {num_clients} clients")
            parts[part] = np.split(index, offsets[1:-1])
        clients = [
            ClientSplit(parts["train"][i], parts["val"][i], parts["test"][i])
            for i in range(num_clients)
        ]
        return cls(clients, arrays["unseen"])


# --------------------------------------------------------------------------- schemes


@dataclass(frozen=True)
class _Settings:
    alpha: float
    beta: float
    classes_per_client: int
    min_samples: int  # per client (train + val), so every client can have a validation split


# A scheme returns each client's train+val share, and its test indices when the data dictates
# them (natural groups); otherwise the test split is dealt by label proportions afterwards.
_Shares = tuple[list[np.ndarray], list[np.ndarray] | None]


def _indices_by_label(labels: np.ndarray, rng: np.random.Generator) -> dict[int, np.ndarray]:
    """Each label's sample indices, in a random order."""
    return {int(k): rng.permutation(np.flatnonzero(labels == k)) for k in np.unique(labels)}


def _dirichlet_split(
    labels: np.ndarray, num_clients: int, alpha: float, min_samples: int, rng: np.random.Generator
) -> tuple[list[np.ndarray], np.ndarray]:
    """Per label, q ~ Dir(alpha 1_M) and that label's samples cut in proportions q.

    As FedLab and the authors' code do, the whole draw is repeated (same rng) until every
    client holds at least `min_samples`. Returns the shares and q [labels, clients].
    """
    by_label = _indices_by_label(labels, rng)
    sizes = np.array([len(v) for v in by_label.values()], dtype=np.int64)
    for _ in range(_MAX_DRAWS):
        q = rng.dirichlet(np.full(num_clients, alpha), size=len(sizes))
        cuts = np.floor(np.cumsum(q, axis=1) * sizes[:, None]).astype(np.int64)
        cuts[:, -1] = sizes  # the cumulative sum may fall short of 1 by rounding
        counts = np.diff(cuts, axis=1, prepend=0)
        if counts.sum(axis=0).min() >= min_samples:
            break
    else:
        raise PartitionError(
            f"dirichlet(alpha={alpha}) left some of the {num_clients} clients with fewer than "
            f"{min_samples} training samples in {_MAX_DRAWS} draws; use fewer clients or a "
            "larger alpha"
        )
    pieces = [np.split(idx, cuts[k, :-1]) for k, idx in enumerate(by_label.values())]
    shares = [np.concatenate([p[m] for p in pieces]) for m in range(num_clients)]
    return shares, q


def _dirichlet(ds: Dataset, num_clients: int, rng: np.random.Generator, s: _Settings) -> _Shares:
    shares, _ = _dirichlet_split(ds.y_train, num_clients, s.alpha, s.min_samples, rng)
    return shares, None


def _pachinko(ds: Dataset, num_clients: int, rng: np.random.Generator, s: _Settings) -> _Shares:
    """Two-level LDA of Reddi et al. (Adaptive Federated Optimization, CIFAR-100).

    Each client draws coarse proportions ~ Dir(alpha) over the coarse labels and, for each
    coarse label, fine proportions ~ Dir(beta) over its fine labels. It then takes N // M
    samples one at a time: a coarse label, then a fine label, then an unused sample of that
    fine label (without replacement). A label that runs out is removed from every client's
    proportions (renormalising); if a client's remaining mass is zero it draws uniformly among
    the labels left. The N mod M samples left over go to no client.
    """
    if ds.coarse_train is None:
        raise PartitionError(
            f"pachinko needs coarse labels (CIFAR-100); dataset {ds.name!r} has none"
        )
    pairs = np.unique(np.stack([ds.y_train, ds.coarse_train], axis=1), axis=0)
    fine_labels, fine_counts = np.unique(pairs[:, 0], return_counts=True)
    if np.any(fine_counts > 1):
        bad = fine_labels[fine_counts > 1][0]
        raise PartitionError(f"pachinko: fine label {bad} appears under several coarse labels")
    per_client = len(ds.y_train) // num_clients
    if per_client < s.min_samples:
        raise PartitionError(
            f"pachinko gives each client {len(ds.y_train)} // {num_clients} = {per_client} "
            f"samples, fewer than the {s.min_samples} needed; use fewer clients"
        )
    coarse_ids = np.unique(pairs[:, 1])
    fine_of = [pairs[pairs[:, 1] == c, 0] for c in coarse_ids]
    pools = _indices_by_label(ds.y_train, rng)
    taken = dict.fromkeys(pools, 0)
    fine_left = [np.ones(len(f), dtype=bool) for f in fine_of]
    coarse_left = np.ones(len(coarse_ids), dtype=bool)
    coarse_p = rng.dirichlet(np.full(len(coarse_ids), s.alpha), size=num_clients)
    fine_p = [rng.dirichlet(np.full(len(f), s.beta), size=num_clients) for f in fine_of]

    shares = []
    for m in range(num_clients):
        share = np.empty(per_client, dtype=np.int64)
        # Cumulative weights are cached per client and rebuilt only when a label runs out.
        coarse_cum: list[float] | None = None
        fine_cum: dict[int, list[float]] = {}
        for i, (u_coarse, u_fine) in enumerate(rng.random((per_client, 2)).tolist()):
            if coarse_cum is None:
                coarse_cum = _cumulative(coarse_p[m], coarse_left)
            c = _draw(coarse_cum, u_coarse)
            if c not in fine_cum:
                fine_cum[c] = _cumulative(fine_p[c][m], fine_left[c])
            j = _draw(fine_cum[c], u_fine)
            label = int(fine_of[c][j])
            share[i] = pools[label][taken[label]]
            taken[label] += 1
            if taken[label] == len(pools[label]):
                fine_left[c][j] = False
                coarse_left[c] = fine_left[c].any()
                coarse_cum = None
                del fine_cum[c]
        shares.append(share)
    return shares, None


def _cumulative(p: np.ndarray, left: np.ndarray) -> list[float]:
    """Cumulative weights over the labels still available (uniform if p has no mass there)."""
    weights = p * left
    if weights.sum() <= 0:
        weights = left.astype(float)
    return np.cumsum(weights).tolist()


def _draw(cum: list[float], u: float) -> int:
    """Index drawn with probability proportional to its weight, for u uniform in [0, 1)."""
    i = bisect.bisect_right(cum, u * cum[-1])
    # u * total can round up to total; then take the last entry with positive weight.
    return i if i < len(cum) else bisect.bisect_left(cum, cum[-1])


def _pathological(ds: Dataset, num_clients: int, rng: np.random.Generator, s: _Settings) -> _Shares:
    """Each client gets shards of exactly `classes_per_client` distinct classes (paper's "v2").

    Classes are shuffled and dealt round-robin, c consecutive ones per client, so every client
    holds c distinct classes and each class goes to about M*c/K clients; then each class's
    samples (sorted by label, shuffled within) are cut into one equal shard per holder.
    """
    classes = np.unique(ds.y_train)
    c = s.classes_per_client
    if c > len(classes):
        raise PartitionError(
            f"classes_per_client={c} is more than the {len(classes)} classes in the training set"
        )
    class_order = rng.permutation(classes)
    holders: dict[int, list[int]] = {int(k): [] for k in classes}
    for slot, m in enumerate(rng.permutation(num_clients)):
        for j in range(c):
            holders[int(class_order[(slot * c + j) % len(classes)])].append(int(m))
    by_label = _indices_by_label(ds.y_train, rng)
    pieces: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for k, clients in holders.items():
        if not clients:
            continue
        if len(by_label[k]) < len(clients):
            raise PartitionError(
                f"pathological: class {k} has {len(by_label[k])} samples for {len(clients)} "
                "clients; use fewer clients or more classes_per_client"
            )
        for m, shard in zip(clients, np.array_split(by_label[k], len(clients)), strict=True):
            pieces[m].append(shard)
    shares = [np.concatenate(p) for p in pieces]
    smallest = min(len(p) for p in shares)
    if smallest < s.min_samples:
        raise PartitionError(
            f"pathological: a client gets {smallest} samples, fewer than the {s.min_samples} "
            "needed; use fewer clients"
        )
    return shares, None


def _natural(ds: Dataset, num_clients: int, rng: np.random.Generator, s: _Settings) -> _Shares:
    """One client per natural group (writer, speaking role); its test split is its own.

    With fewer clients than groups, the largest groups are kept (ties by group id), so a
    small simulation still has clients with enough data to build a useful datastore.
    """
    if ds.groups_train is None:
        raise PartitionError(
            f"natural partition needs natural groups (writers or roles); dataset {ds.name!r} "
            "has none (use femnist or shakespeare)"
        )
    groups, counts = np.unique(ds.groups_train, return_counts=True)
    eligible = counts >= s.min_samples
    groups, counts = groups[eligible], counts[eligible]
    if num_clients > len(groups):
        raise PartitionError(
            f"natural: num_clients={num_clients} but only {len(groups)} groups have at least "
            f"{s.min_samples} training samples"
        )
    chosen = np.sort(groups[np.lexsort((groups, -counts))[:num_clients]])
    shares = _members(ds.groups_train, chosen)
    tests = None if ds.groups_test is None else _members(ds.groups_test, chosen)
    return shares, tests


def _members(groups: np.ndarray, chosen: np.ndarray) -> list[np.ndarray]:
    """Sorted indices of each chosen group's samples."""
    order = np.argsort(groups, kind="stable")
    lo = np.searchsorted(groups[order], chosen, side="left")
    hi = np.searchsorted(groups[order], chosen, side="right")
    return [order[a:b] for a, b in zip(lo, hi, strict=True)]


SCHEMES: dict[str, Callable[[Dataset, int, np.random.Generator, _Settings], _Shares]] = {
    "dirichlet": _dirichlet,
    "pachinko": _pachinko,
    "pathological": _pathological,
    "natural": _natural,
}


# --------------------------------------------------------------------------- per-client splits


def _split_val(share: np.ndarray, val_fraction: float, rng: np.random.Generator):
    """Shuffle, then the last val_fraction (>= 1 sample once there are 2) is validation."""
    order = rng.permutation(share)
    n = len(order)
    n_val = 0
    if val_fraction > 0 and n >= 2:
        n_val = min(n - 1, max(1, int(math.floor(val_fraction * n + 0.5))))
    return np.sort(order[: n - n_val]), np.sort(order[n - n_val :])


def _largest_remainder(weights: np.ndarray, total: int) -> np.ndarray:
    """Integers proportional to `weights` summing to `total` (Hamilton's method)."""
    quota = weights * (total / weights.sum())
    counts = np.floor(quota).astype(np.int64)
    counts[np.argsort(-(quota - counts), kind="stable")[: total - int(counts.sum())]] += 1
    return counts


def _deal_test(ds: Dataset, shares: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
    """Each label's test samples, split among clients by their share of that label."""
    num_labels = int(max(ds.num_classes, ds.y_train.max() + 1, ds.y_test.max(initial=0) + 1))
    held = np.stack([np.bincount(ds.y_train[s], minlength=num_labels) for s in shares])
    tests: list[list[np.ndarray]] = [[] for _ in shares]
    for label, idx in _indices_by_label(ds.y_test, rng).items():
        weights = held[:, label]
        if weights.sum() == 0:
            continue  # no client holds this label: its test samples stay unused
        counts = _largest_remainder(weights.astype(float), len(idx))
        for m, piece in enumerate(np.split(idx, np.cumsum(counts)[:-1])):
            tests[m].append(piece)
    return [np.sort(np.concatenate(t)) if t else np.zeros(0, np.int64) for t in tests]


def _check_fraction(value: float, name: str) -> None:
    if not (is_real(value) and 0 <= value < 1):
        raise PartitionError(f"{name} must be in [0, 1), got {value!r}")


def make_partition(
    dataset: Dataset,
    scheme: str,
    num_clients: int,
    *,
    alpha: float = 0.3,
    beta: float = 10.0,
    classes_per_client: int = 2,
    val_fraction: float = 0.2,
    unseen_fraction: float = 0.2,
    seed: int = 0,
) -> Partition:
    """Split `dataset` among `num_clients` clients with `scheme`.

    Every client gets train/val indices into x_train and test indices into x_test; a seeded
    floor(unseen_fraction * M) of them are flagged unseen. The result depends only on `seed`.

    Parameters
    ----------
    dataset : the data set to split (`load_dataset`).
    scheme : a key of SCHEMES: "dirichlet", "pachinko" (CIFAR-100's coarse labels),
        "pathological" or "natural" (one client per writer or speaking role).
    num_clients : M, the number of clients.
    alpha : the Dirichlet concentration (dirichlet; pachinko's coarse level): smaller is more
        heterogeneous.
    beta : pachinko's Dirichlet concentration over each coarse label's fine labels.
    classes_per_client : pathological: the distinct classes each client holds.
    val_fraction : share of each client's training samples held out for validation, in
        [0, 1).
    unseen_fraction : share of clients held out of training (evaluated as new clients).
    seed : the only source of randomness.

    Returns
    -------
    Partition : each client's split and the unseen flags.
    """
    split = SCHEMES.get(scheme)
    if split is None:
        raise PartitionError(f"unknown partition scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    n_train = len(dataset.y_train)
    if not is_integer(num_clients):
        raise PartitionError(f"num_clients must be a positive integer, got {num_clients!r}")
    if num_clients < 1:
        raise PartitionError(f"num_clients must be at least 1, got {num_clients}")
    if num_clients > n_train:
        raise PartitionError(
            f"num_clients={num_clients} is more than the {n_train} training samples"
        )
    for name, value in (("alpha", alpha), ("beta", beta)):
        if not (is_real(value, finite=True) and value > 0):
            raise PartitionError(f"{name} must be a positive number, got {value!r}")
    if not is_integer(classes_per_client) or classes_per_client < 1:
        raise PartitionError(
            f"classes_per_client must be a positive integer, got {classes_per_client!r}"
        )
    _check_fraction(val_fraction, "val_fraction")
    _check_fraction(unseen_fraction, "unseen_fraction")
    min_samples = 2 if val_fraction > 0 else 1
    if num_clients * min_samples > n_train:
        raise PartitionError(
            f"{n_train} training samples cannot give {num_clients} clients {min_samples} "
            "samples each (train + validation); use fewer clients"
        )

    rng = np.random.default_rng(seed)
    settings = _Settings(float(alpha), float(beta), int(classes_per_client), min_samples)
    shares, tests = split(dataset, int(num_clients), rng, settings)
    train_val = [_split_val(share, val_fraction, rng) for share in shares]
    if tests is None:
        tests = _deal_test(dataset, shares, rng)
    unseen = np.zeros(num_clients, dtype=bool)
    n_unseen = int(math.floor(unseen_fraction * num_clients + 1e-9))
    unseen[rng.choice(num_clients, size=n_unseen, replace=False)] = True
    clients = [ClientSplit(tr, va, te) for (tr, va), te in zip(train_val, tests, strict=True)]
    return Partition(clients, unseen)
