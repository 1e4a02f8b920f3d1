"""Choosing one client's datastore to fit its device budget: enumerate configurations (backend x
key dtype x stored samples or prototypes x projection dimension), measure each one's exact bytes
and its kNN-Per accuracy on the client's validation split, keep the best that fits.

Cheap configurations (flat, HNSW) go first, ProtoNN (trained) last. ProtoNN compresses the
datastore, so it is trained only where the budget cannot hold every train sample as float32 keys
(when flat candidates are searched): a compression the budget does not ask for would replace
the datastore that the server's kNN-Per evaluation measured with a model that won on a few
dozen validation samples. Otherwise the search is exhaustive by default;
`SearchSpace.pruned()` stops paying for candidates that look unable to win:
- HNSW stores float32 keys plus links, so flat float32 keys always hold at least as many samples
  in the same room and search them exactly: HNSW is only tried where flat float32 is not.
- successive halving: every ProtoNN candidate gets `protonn_screen_steps` Adam steps, and only
  the `protonn_finalists` best on validation are trained on to `protonn_steps`.
On 20 clients of a Fashion-MNIST run the pruned search was 2.4x faster but changed 14 choices
(ties on a few dozen validation samples broken differently, ProtoNN shapes dropped before they
won) and lost 0.74 pp of test accuracy, so it is opt-in (BENCHMARKS.md)."""

from __future__ import annotations

import hashlib
import itertools
import logging
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge_runtime.budget import Budget
from edge_runtime.datastores import (
    BACKENDS,
    BaseDatastore,
    ProtoNNDatastore,
    SampleDatastore,
    max_count_within,
)
from edge_runtime.head_file import head_nbytes, no_sample_fits, one_sample_room, samples_within
from edge_runtime.knn import datastore_key
from edge_runtime.personal_head import ClientSplits, PersonalHead
from edge_runtime.threads import BlasThreads
from export.errors import BudgetInvalid, ExportError
from export.options import backend_choices
from fed_train.knn_setting import KNNChoice
from protonn.training import ProtoNNClassifier

log = logging.getLogger(__name__)

Datastore = BaseDatastore  # any registered backend


@dataclass
class SearchSpace:
    """The configurations tried per client. Flat and HNSW store the most samples that fit the
    budget (all of them when they fit), plus any `count_fractions` of the train split asked for;
    ProtoNN tries `protonn_fractions` of the train split as prototypes, plus the most that fit.

    Why no smaller sample counts by default: a random subset holds strictly less than the most
    that fit, and choosing among subsets on a validation split of a few dozen samples picks
    noise. On a 20-client Fashion-MNIST run, dropping them raised the flat choice's test
    accuracy from 0.824 to 0.836 at a budget of the full datastore (0.836 with no budget) and
    from 0.818 to 0.825 at a quarter of it."""

    backends: tuple[str, ...] = field(default_factory=lambda: tuple(BACKENDS))
    flat_dtypes: tuple[str, ...] = ("fp32", "fp16", "int8")
    count_fractions: tuple[float, ...] = (1.0,)
    hnsw_M: tuple[int, ...] = (8, 16)
    hnsw_ef: int = 64
    protonn_dims: tuple[int, ...] = (8, 16, 32)
    protonn_fractions: tuple[float, ...] = (0.1, 0.3)
    protonn_steps: int = 200
    protonn_screen_steps: int | None = None  # successive halving: steps every candidate gets
    protonn_finalists: int = 3  # ... and how many go on to protonn_steps
    fill_budget: bool = True  # also try the most samples / prototypes that fit
    prune: bool = False  # skip HNSW where it cannot win, halve ProtoNN's finalists (module doc)
    # share of the train split a ProtoNN datastore reserves room for, as its buffer of samples
    # added on the device (the exporter sets it unless the update strategy is "fixed")
    protonn_buffer: float = 0.0
    # bytes of one sample's raw input that every flat or HNSW datastore keeps beside its key
    # (x<bytes>), so `knnper-edge upgrade` re-embeds exactly; counted in its bytes, so a budget
    # holds fewer keys. None: no raw inputs kept
    inputs: int | None = None

    def pruned(self, screen_steps: int = 50) -> SearchSpace:
        """This space with the pruning rules and successive halving of the module's doc."""
        return SearchSpace(**{**self.__dict__, "prune": True, "protonn_screen_steps": screen_steps})

    def restricted_to(self, backend: str) -> SearchSpace:
        """This space with only one backend ("auto" keeps them all)."""
        if backend not in backend_choices():
            raise ExportError(f"unknown backend {backend!r}; known: {', '.join(backend_choices())}")
        if backend == "auto":
            return self
        return SearchSpace(**{**self.__dict__, "backends": (backend,)})


@dataclass
class Candidate:
    """One configuration as measured: its exact bytes and validation score."""

    recipe: str
    backend: str
    nbytes: int
    stored: int  # samples (flat, hnsw) or prototypes (protonn) actually held
    lam: float = 0.5
    val_accuracy: float | None = None
    val_nll: float | None = None
    steps: int | None = None  # ProtoNN: the Adam steps it was trained for

    def as_row(self) -> dict[str, Any]:
        """Every field in order, nbytes and lam as export.json names them (bytes, lambda)."""
        named = {"nbytes": "bytes", "lam": "lambda"}
        return {named.get(name, name): value for name, value in asdict(self).items()}


def measure_nbytes(datastore: Datastore) -> int:
    """Exact on-disk bytes of a datastore as a bundle holds it: save it for real, with the
    embedding id a bundle records in it (edge_runtime.versions), and add up its files."""
    unstamped = getattr(datastore, "embedding_id_", None) is None
    if unstamped:
        datastore.embedding_id_ = "0" * 64  # its size, not its value, counts here
    try:
        with tempfile.TemporaryDirectory(prefix="knnper-size-") as tmp:
            names = datastore.save(tmp)
            return sum((Path(tmp) / name).stat().st_size for name in names)
    finally:
        if unstamped:
            datastore.embedding_id_ = None


def smallest_datastore_bytes(
    space: SearchSpace, num_classes: int, dim: int, head_classes: int | None = None
) -> int:
    """Bytes of the smallest datastore the space allows (one stored sample by
    `samples_within`'s rule, the refitted head's file included where `head_classes` is
    given, or one prototype at the smallest projection): a budget with less room than this
    cannot get a bundle."""
    configs = sample_configs(space, num_classes)
    sizes = [one_sample_room(configs, dim, head_classes)] if configs else []
    if ProtoNNDatastore.backend in space.backends and space.protonn_dims:
        d = min(space.protonn_dims)
        ds = ProtoNNDatastore.from_matrices(
            np.zeros((d, dim)), np.zeros((d, 1)), np.zeros((num_classes, 1)), 1.0, m=1.0
        )
        sizes.append(measure_nbytes(ds))
    if not sizes:
        raise ExportError("the search space has no datastore configuration to try")
    return min(sizes)


def sample_configs(space: SearchSpace, num_classes: int, **params: Any) -> list[SampleDatastore]:
    """The unfitted configurations of the space's sample-storing backends (every registered
    class not TRAINED): per backend, the product of its class's SEARCH_AXES, read from the
    space where an axis names a field of it. A pruned space drops a backend whose
    DOMINATED_BY recipe is among them (the module's doc). With `space.inputs`, each keeps
    every stored sample's raw input."""
    if space.inputs is not None:
        params = {**params, "inputs": space.inputs}
    configs = []
    for backend in space.backends:
        cls = BACKENDS.get(backend)
        if cls is None:
            raise ExportError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
        if cls.TRAINED:
            continue
        axes = cls.SEARCH_AXES
        grids = [_axis_values(space, values) for values in axes.values()]
        configs += [
            cls(num_classes, **params, **dict(zip(axes, point, strict=True)))
            for point in itertools.product(*grids)
        ]
    if space.prune:
        recipes = {c.recipe for c in configs}
        configs = [c for c in configs if c.DOMINATED_BY not in recipes]
    return configs


def _axis_values(space: SearchSpace, axis: str | tuple) -> tuple:
    values = getattr(space, axis) if isinstance(axis, str) else axis
    return tuple(values) if isinstance(values, tuple | list) else (values,)


def selection_key(c: Candidate) -> tuple:
    """edge_runtime.knn.datastore_key: the order `knnper-edge init` ranks its candidates by.
    Its log-loss rounding keeps the tiny differences that key quantization causes (fp32
    against int8 keys) from outweighing a 4x saving in bytes."""
    return datastore_key(
        c.val_accuracy, c.val_nll, trained=BACKENDS[c.backend].TRAINED, nbytes=c.nbytes
    )


class DatastoreSizer:
    """Per client: enumerate datastores that fit the budget's room (what the encoder leaves),
    score each with kNN-Per on the validation split as `knn` runs it (k, sigma, and lambda
    chosen by its estimator and rule: with "loo+val" on that split plus leave-one-out
    posteriors of the client's train embeddings as float32 keys, the datastore a full flat
    fp32 candidate holds; compressed candidates share that datastore half), and keep the best.
    scikit-learn style: settings here (None: the paper's kNN-Per), work in `fit`, results in
    `best_`, `datastore_`, `candidates_` (and `fitted_`: each candidate with its fitted
    datastore)."""

    def __init__(
        self,
        num_classes: int,
        *,
        knn: KNNChoice | None = None,
        space: SearchSpace | None = None,
        seed: int = 0,
        reuse_protonn: bool = False,
    ) -> None:
        self.num_classes = num_classes
        self.knn = knn or KNNChoice()
        self.space = space or SearchSpace()
        self.seed = seed
        # Benchmarks size the same client under many budgets; a ProtoNN of a given shape on the
        # same embeddings is the same model each time, so it may be trained once (the
        # classifier, to train on, and its datastore after each number of steps).
        self.reuse_protonn = reuse_protonn
        self._protonn_cache: dict[tuple, Any] = {}

    # -- the search
    def fit(
        self, data: ClientSplits, budget: Budget, inputs: np.ndarray | None = None
    ) -> DatastoreSizer:
        """`inputs`: the raw inputs of the train split, one per row of data.z_train, where the
        space keeps them (`SearchSpace.inputs`).

        numpy's BLAS runs on one thread meanwhile (as torch does in ProtoNN's training): the
        search's matrices are one client's, an export sizes clients in one process per core,
        and OpenBLAS's default of a busy-waiting thread per core in every process made a
        20-client Fashion-MNIST export take 1.8x the CPU time (the same bytes written)."""
        with BlasThreads(1)():
            return self._search(data, budget, inputs)

    def _search(
        self, data: ClientSplits, budget: Budget, inputs: np.ndarray | None
    ) -> DatastoreSizer:
        room = budget.room
        if (inputs is None) != (self.space.inputs is None):
            raise ExportError(
                f"client {data.client_id}: the search space keeps raw inputs "
                f"({self.space.inputs} bytes each) exactly when they are given"
            )
        trained = [b for b in self.space.backends if BACKENDS[b].TRAINED]
        if inputs is not None and trained:
            raise ExportError(f"{', '.join(trained)} datastores cannot keep raw inputs")
        self._inputs = inputs
        if len(data.y_train) == 0:
            raise ExportError(
                f"client {data.client_id} has no training samples to build a datastore from"
            )
        if not self.reuse_protonn:
            self._protonn_cache = {}  # within one fit: the classifiers the finalists train on
        self._loo = (
            self._head().leave_one_out(data) if self.knn.lambda_estimator == "loo+val" else None
        )
        candidates: list[tuple[Candidate, Datastore]] = []
        seen: set[tuple[str, int]] = set()
        samples = budget.with_head(head_nbytes(data.z_train.shape[1], self._head_classes()))
        for build in self._builders(data, samples):
            made = build()
            if made is None:
                continue
            cand, ds = made
            # Two recipes that hold the same samples (e.g. counts above the train size) are the
            # same datastore: score it once.
            signature = (cand.recipe.split(":n")[0], cand.stored)
            if signature in seen:
                continue
            seen.add(signature)
            self._score(cand, ds, data)
            candidates.append((cand, ds))
            log.debug(
                "client %d: %s %d bytes acc %s",
                data.client_id,
                cand.recipe,
                cand.nbytes,
                cand.val_accuracy,
            )
        if ProtoNNDatastore.backend in self.space.backends and not self._holds_all_fp32(
            candidates, data
        ):
            candidates += self._protonn_search(data, room)
        if not candidates:
            configs, dim = list(self._sample_configs()), data.z_train.shape[1]
            if configs and not any(samples_within(c, dim, samples) for c in configs):
                protonn = " (and no ProtoNN datastore fits either)" if trained else ""
                why = no_sample_fits(samples, configs, dim)
                raise BudgetInvalid(f"client {data.client_id}: {why}{protonn}")
            raise BudgetInvalid(
                f"client {data.client_id}: the budget leaves {room} bytes after the encoder, too "
                f"few for any datastore of backend(s) {', '.join(self.space.backends)}"
            )
        if len(data.y_val) == 0:
            # No validation split to judge by: the most stored samples that fit, searched
            # exactly (flat), at the highest precision (most bytes).
            best_pair = max(
                candidates, key=lambda cd: (cd[0].stored, cd[1].EXACT_SEARCH, cd[0].nbytes)
            )
        else:
            best_pair = min(candidates, key=lambda cd: selection_key(cd[0]))
        self.best_, self.datastore_ = best_pair
        self.candidates_ = [c for c, _ in candidates]
        self.fitted_ = candidates  # every (candidate, fitted datastore), for benchmarks
        return self

    def _holds_all_fp32(
        self, candidates: list[tuple[Candidate, Datastore]], data: ClientSplits
    ) -> bool:
        """Whether a flat float32 datastore of every train sample fits (then ProtoNN is not
        trained: the module's doc says why)."""
        return any(ds.exact_fp32 and c.stored == len(data.y_train) for c, ds in candidates)

    def _head(self) -> PersonalHead:
        """A candidate's head, on what the client's encoder outputs as a device runs it: its
        embeddings normalised inside the graph, and its logits the global model's or, with
        the linear base, the client's linear head's (inside its own encoder)."""
        return self.knn.head(self.num_classes, normalized=True, linear_in_logits=True)

    def _score(self, cand: Candidate, ds: Datastore, data: ClientSplits) -> None:
        head = self._head().fit(data, datastore=ds, loo=self._loo)
        cand.lam, cand.val_accuracy, cand.val_nll = (
            head.lambda_,
            head.val_accuracy_,
            head.val_nll_,
        )

    # -- enumeration
    def _counts(self, n_train: int, most: int) -> list[int]:
        counts = {max(1, int(round(f * n_train))) for f in self.space.count_fractions}
        if self.space.fill_budget:
            counts.add(min(most, n_train))
        return sorted((c for c in counts if c <= most), reverse=True)

    def _head_classes(self) -> int | None:
        """With the linear base, a device's first `add` refits the head into its own file,
        taken from the datastore's share: flat and HNSW datastores are sized to leave it room
        (a ProtoNN datastore keeps prototypes, and its head is never refitted)."""
        return self.num_classes if self.knn.base == "linear" else None

    def _builders(
        self, data: ClientSplits, budget: Budget
    ) -> Iterator[Callable[[], tuple[Candidate, Datastore] | None]]:
        """Per flat or HNSW configuration, each sample count to try. Its capacity (what fifo
        may later grow to) is the most samples `samples_within` allows in `budget`, the rule
        `add` and `upgrade` hold the bundle to; none where not one sample fits."""
        n, dim = data.z_train.shape
        for config in self._sample_configs():
            capacity = samples_within(config, dim, budget)
            for count in self._counts(n, min(n, capacity)):
                yield _bind(self._fit_within, config, data, count, capacity, budget.sample_room)

    def _sample_configs(self) -> Iterator[SampleDatastore]:
        """The flat and HNSW configurations to fill with samples (ProtoNN is trained after
        them: see _protonn_search), unfitted and with no sample count yet."""
        yield from sample_configs(
            self.space,
            self.num_classes,
            k=self.knn.config.k,
            sigma=self.knn.config.sigma,
            seed=self.seed,
        )

    def _fit_within(
        self, config: SampleDatastore, data: ClientSplits, count: int, capacity: int, room: int
    ) -> tuple[Candidate, Datastore] | None:
        """`config` fitted with `count` samples, its exact bytes measured. Over `room` (the
        estimate bounds the files from above, so this is a safeguard): shrink the count in
        proportion until it fits. The count is never grown past what `estimate_nbytes` (files
        and the memory a device holds beside them) allows: that estimate is what `add` and
        `knnper-edge upgrade` hold the bundle to, so an exported bundle must pass it too, or an
        upgrade to a same-size encoder would evict. `capacity`: see _counts_within."""
        n_train = len(data.y_train)
        while 1 <= count <= n_train:
            params = {**config.get_params(), "n": _n_param(count, n_train, capacity)}
            ds = type(config)(**params).fit(data.z_train, data.y_train, self._inputs)
            nbytes = measure_nbytes(ds)
            if nbytes <= room:
                return Candidate(ds.recipe, config.backend, nbytes, len(ds)), ds
            count = min(count - 1, int(count * room / nbytes))
        return None

    def _protonn_shapes(self, data: ClientSplits, room: int) -> list[tuple[int, int]]:
        """(projection dim, prototypes) pairs whose estimated bytes fit the room."""
        n, dim = data.z_train.shape
        shapes = []
        for d in self.space.protonn_dims:
            probe = ProtoNNDatastore(self.num_classes, d=d, buffer=self._protonn_buffer(n))
            most = _most_within(lambda m, probe=probe: probe.estimate_nbytes(m, dim), room, n)
            counts = {min(n, max(1, int(round(f * n)))) for f in self.space.protonn_fractions}
            if self.space.fill_budget and most >= 1:
                # ProtoNN is there to compress: more prototypes than half the samples is the
                # flat backends' ground, and would cost training time for little.
                counts.add(min(most, max(1, n // 2)))
            shapes += [(d, m) for m in sorted((c for c in counts if c <= most), reverse=True)]
        return shapes

    def _protonn_buffer(self, n_train: int) -> int | None:
        """The buffer capacity a ProtoNN datastore reserves room for (None: no buffer)."""
        share = self.space.protonn_buffer
        return max(1, round(share * n_train)) if share else None

    def _protonn_search(self, data: ClientSplits, room: int) -> list[tuple[Candidate, Datastore]]:
        """Successive halving: every shape that fits gets the screening steps, the best
        `protonn_finalists` on validation get the rest; every model is a candidate with the
        score it has when its training stops."""
        space = self.space
        screen = min(space.protonn_screen_steps or space.protonn_steps, space.protonn_steps)
        scored: dict[tuple[int, int], tuple[Candidate, Datastore]] = {}
        for shape in self._protonn_shapes(data, room):
            made = self._protonn(data, *shape, screen, room)
            if made is not None:
                self._score(*made, data)
                scored[shape] = made
        if screen < space.protonn_steps:
            ranked = sorted(scored, key=lambda shape: selection_key(scored[shape][0]))
            for shape in ranked[: space.protonn_finalists]:
                made = self._protonn(data, *shape, space.protonn_steps, room)
                if made is not None:
                    self._score(*made, data)
                    scored[shape] = made
        for cand, _ in scored.values():
            log.debug(
                "client %d: %s %d bytes acc %s (%d steps)",
                data.client_id,
                cand.recipe,
                cand.nbytes,
                cand.val_accuracy,
                cand.steps,
            )
        return list(scored.values())

    def _protonn(
        self, data: ClientSplits, d: int, m: int, steps: int, room: int
    ) -> tuple[Candidate, Datastore] | None:
        """The (d, m) ProtoNN trained to `steps` (continuing its earlier training, if any)."""
        shape = (
            data.client_id,
            d,
            m,
            hashlib.sha1(np.ascontiguousarray(data.z_train).data).hexdigest(),
        )
        ds = self._protonn_cache.get((*shape, steps))
        if ds is None:
            clf = self._protonn_cache.get(shape)
            if clf is None or clf.steps_done_ > steps:
                clf = ProtoNNClassifier(
                    self.num_classes, projection_dim=d, n_prototypes=m, steps=steps, seed=self.seed
                )
            clf.partial_fit(data.z_train, data.y_train, steps - getattr(clf, "steps_done_", 0))
            fraction = float(f"{clf.n_prototypes_ / len(data.y_train):.4g}")
            ds = clf.to_datastore(k=self.knn.config.k, sigma=self.knn.config.sigma, m=fraction)
            self._protonn_cache[shape] = clf
            self._protonn_cache[(*shape, steps)] = ds
        ds.buffer = self._protonn_buffer(len(data.y_train))
        nbytes = measure_nbytes(ds)
        # with a buffer: the bytes the runtime expects once the buffer is full
        full = ds.estimate_nbytes(len(ds), data.z_train.shape[1]) if ds.buffer else nbytes
        if max(nbytes, full) > room:
            return None
        return Candidate(ds.recipe, ds.backend, nbytes, len(ds), steps=steps), ds


def _bind(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    return lambda: fn(*args)


def _n_param(count: int, n_train: int, capacity: int) -> int:
    """The recipe's n: the stored count, or, when every train sample is stored, the budget's
    capacity, so that fifo updates on the device may grow the datastore into the room left."""
    return count if count < n_train else max(count, capacity)


def _most_within(estimate: Callable[[int], int], room: int, n: int) -> int:
    """The most items (<= n) whose estimated bytes fit `room` (a starting point: exact bytes are
    measured on the fitted datastore, see `_fit_within`)."""
    return min(n, max_count_within(estimate, room))
