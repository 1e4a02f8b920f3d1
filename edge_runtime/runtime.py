"""The device runtime: load a verified bundle, predict with kNN-Per, learn from labelled samples.

    rt = Runtime.load("bundle/")
    rt.predict_proba(images)            # [N, C]: lambda * p_knn + (1 - lambda) * softmax(logits)
    rt.add(images, labels)              # the manifest's update strategy, persisted crash-safely

`predict_proba` runs the whole prediction as one onnxruntime session (predictor.py) for flat
float32 / int8 and ProtoNN bundles, and through the encoder and the numpy head (knn.py, the
reference) for HNSW and float16 keys. A bundle holds one session: for the single-session ones
`embed` (and `add`, `components`) take the encoder's outputs from the predictor's session;
`components` and `posterior` always use the numpy head. `add_chunks` takes samples as chunks
(a file read lazily): only the newest ones a strategy keeps are embedded.

Update strategies (`add(x, y, strategy)`), with "capacity" = the recipe's n<count> if it has one,
else the number of samples stored when the bundle was loaded:
- fifo: add the new samples, then evict the oldest until the datastore holds at most
  `capacity` samples (if more new samples than the capacity arrive, only the newest are kept).
  It can grow up to the capacity, never past it, and never past the budget.
- concatenate: add everything; if the files would exceed the bundle's budget, evict the oldest
  until they fit and log a warning saying so. The recipe's n grows with the datastore.
- fixed: the datastore stays as it is (inputs are still checked).
A bundle with the linear base (its manifest records the exporter's l2) also refits its linear
head after every update, on the samples a flat or HNSW datastore then stores (a ProtoNN one keeps
prototypes, not samples: its head stays the exporter's); see edge_runtime.head_file. The fit is
numpy L-BFGS with at most LinearHead's max_iter iterations, so it is bounded in time, and its
file's bytes come out of the datastore's room.
The samples a strategy adds to and evicts from are the datastore's `sample_store()`: a flat or
HNSW datastore's stored samples, or a ProtoNN datastore's buffer of new samples beside its
prototypes (capacity: the recipe's b<count>; its prototypes are never evicted).

Several processes may share one bundle: `add` holds the bundle's exclusive lock from checking
that the manifest on disk is still the one this runtime loaded to committing the next one, so no
acknowledged sample is ever lost. A runtime whose bundle was updated by another process since it
loaded gets a BundleError ("load it again") and changes nothing; one that waits longer than
`lock_timeout` for the lock gets BundleBusy.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .budget import Budget
from .bundle import (
    UPDATE_STRATEGIES,
    BudgetExceeded,
    BundleError,
    bundle_lock,
    check_sessions,
    commit_datastore,
    encoder_model,
    load_bundle_datastore,
    open_sessions,
    read_bundle,
    read_manifest,
)
from .encoder import Encoder
from .head_file import head_nbytes, refit_head, refits, samples_within
from .knn import softmax
from .linear_head import LinearHead
from .locking import DEFAULT_LOCK_TIMEOUT
from .manifest import Manifest
from .personal_head import PersonalHead
from .predictor import Predictor
from .preprocess import InputSpec, prepare_checked, raw_checked
from .release import bundle_release_problem
from .threads import DEFAULT_THREADS, BlasThreads
from .upgrade import UpgradeReport, upgrade_bundle
from .versions import ModelVersion

logger = logging.getLogger(__name__)

# Samples `add` checks (and embeds, when it keeps them) at a time: bounds its working memory.
ADD_CHUNK_ROWS = 4096


@dataclass
class UpdateReport:
    """What one `add` did: samples kept from the new ones, old samples evicted, final size.

    Parameters
    ----------
    strategy : the update strategy applied ("fifo", "concatenate" or "fixed").
    received : samples passed to `add`.
    added : of them, the samples stored.
    evicted : old samples removed to make room.
    size : samples stored after the update.
    footprint_bytes : the bundle's total bytes after the update.
    """

    strategy: str
    received: int
    added: int
    evicted: int
    size: int
    footprint_bytes: int

    @property
    def dropped(self) -> int:
        """Received samples not added: over the datastore's room (the oldest of them go), or
        all of them under the fixed strategy."""
        return self.received - self.added


def check_labels(y: object, n: int, num_classes: int) -> np.ndarray:
    """Labels for n samples: integers in [0, num_classes), one per sample (a scalar for one)."""
    y = np.asarray(y)
    if y.dtype.kind not in "iu":
        raise ValueError(f"labels must be integers, got dtype {y.dtype}")
    y = y.reshape(1) if y.ndim == 0 else y
    if y.ndim != 1:
        raise ValueError(f"labels must be a 1-D array, got shape {list(y.shape)}")
    if y.shape[0] != n:
        raise ValueError(f"got {y.shape[0]} labels for {n} samples")
    if n and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels must be in [0, {num_classes}), got range [{y.min()}, {y.max()}]")
    return y.astype(np.int64)


class Runtime:
    """Personalized inference on one device from one bundle. Build it with `Runtime.load`."""

    def __init__(
        self,
        path: Path,
        manifest: Manifest,
        encoder: Encoder | None,
        datastore,
        *,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
        blas_threads: int | None = DEFAULT_THREADS,
        predictor: Predictor | None = None,
        intra_op_threads: int | None = DEFAULT_THREADS,
    ) -> None:
        self.path = Path(path)
        self.manifest = manifest
        self.encoder = encoder
        self.datastore = datastore
        self.predictor = predictor
        self.lock_timeout = lock_timeout
        self.size_at_load_ = len(datastore.sample_store())
        self._blas_threads = BlasThreads(blas_threads)
        self._intra_op_threads = intra_op_threads

    @classmethod
    def load(
        cls,
        bundle_dir: str | os.PathLike,
        *,
        intra_op_threads: int | None = DEFAULT_THREADS,
        blas_threads: int | None = DEFAULT_THREADS,
        trusted_keys: Sequence[Any] | None = None,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    ) -> Runtime:
        """Verify the bundle (schema, version, sha256s, budget, dimensions; its signature when
        `trusted_keys` are given) and load it.

        Parameters
        ----------
        bundle_dir : a bundle's folder (a `client_NNNN` that `knnper export` wrote, or one from
            `init_bundle`).
        intra_op_threads : onnxruntime's threads; 1 is fastest at batch 1, None leaves its
            default.
        blas_threads : numpy's BLAS threads, set only while the runtime computes; None leaves
            its default.
        trusted_keys : Ed25519 public keys (`signing.load_public_key`); given, an unsigned
            bundle, or one signed by another key or edited since, is refused.
        lock_timeout : seconds to wait for another process's update of the bundle to finish.

        Raises
        ------
        BundleError : one line naming the bundle, the file and what is wrong with it.

        A bundle whose folder's release record (export.json beside it) names another model
        version loads, with one warning line saying so: the folder mixes two releases.
        """
        bundle = read_bundle(
            bundle_dir,
            intra_op_threads=intra_op_threads,
            trusted_keys=trusted_keys,
            lock_timeout=lock_timeout,
            with_predictor=True,
        )
        mixed = bundle_release_problem(bundle.path, bundle.manifest)
        if mixed is not None:
            logger.warning("%s", mixed)
        parts = (bundle.path, bundle.manifest, bundle.encoder, bundle.datastore)
        return cls(
            *parts,
            lock_timeout=lock_timeout,
            blas_threads=blas_threads,
            predictor=bundle.predictor,
            intra_op_threads=intra_op_threads,
        )

    # -- properties from the manifest
    @property
    def num_classes(self) -> int:
        return int(self.manifest.num_classes)

    @property
    def lam(self) -> float:
        return self.manifest.lam

    @property
    def head(self) -> PersonalHead:
        """The bundle's personal head: its datastore and lambda over the encoder's outputs."""
        return PersonalHead.fitted(self.num_classes, self.datastore, self.lam)

    @property
    def budget(self) -> Budget:
        """What the bundle may take, the encoder's share in it, and the datastore's room."""
        return self.manifest.budget

    @property
    def version(self) -> ModelVersion | None:
        """The model version the bundle runs (its manifest's record, else its keys' encoder);
        None for a bundle from before versions."""
        return self.manifest.model or ModelVersion.of_keys(self.datastore)

    @property
    def input_spec(self) -> InputSpec:
        return self.manifest.input

    @property
    def capacity(self) -> int:
        """The fifo size: the recipe's n (protonn: its buffer b) when set, else the number of
        samples stored when loaded."""
        n = self.datastore.sample_store().n
        return int(n) if n is not None else self.size_at_load_

    # -- inference
    def embed(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Raw inputs -> (embeddings [N,p], logits [N,C]); input checks happen here."""
        batch = self._checked(x)
        if batch.shape[0] == 0:
            dim = self.manifest.embedding_dim
            return np.zeros((0, dim), np.float32), np.zeros((0, self.num_classes), np.float32)
        return self._encode(batch)

    def _checked(self, x: np.ndarray) -> np.ndarray:
        """Checked inputs as a batch in the form the bundle's session takes: raw for the
        single-session predictor (it normalises in its graph), normalised for the encoder."""
        if self.predictor is not None:
            return raw_checked(x, self.manifest.input)
        return prepare_checked(x, self.manifest.input)

    def _encode(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A `_checked` batch (N >= 1) -> (embeddings, logits) through the bundle's session."""
        if self.predictor is not None:
            return self.predictor.embed(batch, self.datastore)
        return self.encoder.run(batch)

    def components(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(p_local from the datastore, p_global = softmax(logits)), each [N, C]."""
        z, logits = self.embed(x)
        if z.shape[0] == 0:
            empty = np.zeros((0, self.num_classes))
            return empty, empty
        head = self.head
        with self._blas_threads():
            return head.local_proba(z), head.base_proba(z, softmax(logits))

    def posterior(self, z: np.ndarray, logits: np.ndarray) -> np.ndarray:
        """kNN-Per from encoder outputs: lambda * p_local + (1 - lambda) * softmax(logits)."""
        if z.shape[0] == 0:
            return np.zeros((0, self.num_classes))
        with self._blas_threads():
            return self.head.predict_proba(z, softmax(logits))

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        """kNN-Per's personalized class probabilities.

        Parameters
        ----------
        x : raw inputs as the bundle's manifest declares them: uint8 images [N, H, W, C] (or
            one [H, W, C]), or int64 token ids [N, L].

        Returns
        -------
        [N, C] float64 probabilities, each row summing to 1.
        """
        if self.predictor is None:
            return self.posterior(*self.embed(x))
        raw = raw_checked(x, self.manifest.input)
        if raw.shape[0] == 0:
            return np.zeros((0, self.num_classes))
        return self.predictor.run(raw, self.datastore)

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.predict_proba(x).argmax(axis=1)

    # -- learning on the device
    def add(self, x: np.ndarray, y: object, strategy: str | None = None) -> UpdateReport:
        """Embed labelled samples, update the datastore within the budget, and persist the
        bundle crash-safely (a linear head is refitted on what the datastore then stores).

        Parameters
        ----------
        x : raw inputs, as for `predict_proba`.
        y : their labels, integers in [0, C).
        strategy : "fifo" (the newest samples, up to the capacity), "concatenate" (grow while
            the budget has room) or "fixed" (add nothing); None takes the manifest's
            `update_strategy`.

        Returns
        -------
        UpdateReport : how many samples were received, added, dropped (and why) and evicted,
            and how many the datastore holds.
        """
        batch = raw_checked(x, self.manifest.input)
        labels = check_labels(y, batch.shape[0], self.num_classes)
        rows = ADD_CHUNK_ROWS
        chunks = (
            (batch[start : start + rows], labels[start : start + rows])
            for start in range(0, batch.shape[0], rows)
        )
        return self.add_chunks(chunks, batch.shape[0], strategy)

    def add_chunks(
        self,
        chunks: Iterable[tuple[np.ndarray, object]],
        count: int,
        strategy: str | None = None,
    ) -> UpdateReport:
        """`add` of `count` labelled samples that arrive as consecutive (x, y) chunks, oldest
        first: every chunk is checked, but only the newest samples the strategy can keep are
        embedded and held, so memory does not grow with the input (a file read lazily)."""
        strategy = self.manifest.update_strategy if strategy is None else strategy
        if strategy not in UPDATE_STRATEGIES:
            raise ValueError(
                f"update strategy must be one of {list(UPDATE_STRATEGIES)}, got {strategy!r}"
            )
        if strategy == "fifo" and count and self.capacity < 1:
            raise ValueError(
                f"bundle {self.path}: {self.datastore.recipe} reserves no room for new samples "
                "(a protonn recipe needs a buffer, b<count>); use strategy 'concatenate' or "
                "'fixed'"
            )
        target = self._target(strategy) if strategy != "fixed" and count else 0
        first_kept = count - min(count, target)
        keeps_inputs = getattr(self.datastore.sample_store(), "inputs", None) is not None
        zs, kept, raws, seen = [], [], [], 0
        for x, y in chunks:
            xp = self._checked(x)
            labels = check_labels(y, xp.shape[0], self.num_classes)
            skip = max(0, first_kept - seen)
            seen += xp.shape[0]
            if seen > count:
                raise ValueError(f"got more than the {count} samples announced")
            if skip < xp.shape[0]:
                zs.append(self._encode(xp[skip:])[0])
                kept.append(labels[skip:])
                if keeps_inputs:  # the bundle re-embeds them when the model changes
                    raws.append(raw_checked(x, self.manifest.input)[skip:])
        if seen != count:
            raise ValueError(f"got {seen} samples, {count} were announced")
        if not zs:
            return self._report(strategy, count, 0, 0)
        z, labels = np.concatenate(zs), np.concatenate(kept)
        inputs = np.concatenate(raws) if raws else None
        with bundle_lock(self.path, exclusive=True, timeout=self.lock_timeout):
            if read_manifest(self.path) != self.manifest:
                raise BundleError(
                    f"bundle {self.path}: manifest.json changed on disk since the bundle was "
                    "loaded (another writer?); load it again"
                )
            return self._update(z, labels, strategy, count, target, inputs)

    def upgrade(
        self,
        new_bundle: str | os.PathLike,
        *,
        key_map: str | os.PathLike | None = None,
        trusted_keys: Sequence[Any] | None = None,
        force: bool = False,
    ) -> UpgradeReport:
        """Turn this bundle into the version of the release bundle `new_bundle` in place,
        keeping every sample it stores (edge_runtime.upgrade), then reload it. `key_map`: the
        release's map file (default: upgrades/ beside `new_bundle`); `trusted_keys`: verify
        the release's signature; `force`: map even where the release advises otherwise."""
        if Path(new_bundle).resolve() == self.path.resolve():  # it waited on its own lock
            raise BundleError(
                f"bundle {self.path}: --to {new_bundle} is this bundle itself; give the "
                "release's bundle (a client_NNNN folder of the new export)"
            )
        upgraded = False
        try:
            with bundle_lock(self.path, exclusive=True, timeout=self.lock_timeout):
                if read_manifest(self.path) != self.manifest:
                    raise BundleError(
                        f"bundle {self.path}: manifest.json changed on disk since the bundle "
                        "was loaded (another writer?); load it again"
                    )
                # the upgrade needs no session of this version: let it go while the new one
                # is built and checked (bounded memory)
                self.encoder = self.predictor = None
                report = upgrade_bundle(
                    self.path,
                    self.manifest,
                    self._let_go_of_datastore(),
                    new_bundle,
                    key_map=key_map,
                    trusted_keys=trusted_keys,
                    force=force,
                )
            upgraded = True
        finally:
            if self.encoder is None and self.predictor is None:
                # whichever version is on disk now: the new one, verified with the release's
                # keys where it carries the release's signature; or, after a failure, the old
                # one as it was loaded (a bundle a device built itself is unsigned: checking it
                # would hide why the upgrade failed)
                fresh = Runtime.load(
                    self.path,
                    intra_op_threads=self._intra_op_threads,
                    lock_timeout=self.lock_timeout,
                    trusted_keys=trusted_keys if upgraded and report.signed else None,
                )
                fresh._blas_threads = self._blas_threads
                self.__dict__.update(fresh.__dict__)
        return report

    def kept_by_add(self, strategy: str | None = None) -> int:
        """The most samples the datastore holds after `add` by `strategy` (default: the
        manifest's): `add` appends the new samples after the stored ones and evicts the oldest
        beyond this many ('fixed' adds none: what is stored now)."""
        strategy = self.manifest.update_strategy if strategy is None else strategy
        if strategy == "fixed":
            return len(self.datastore.sample_store())
        return self._target(strategy)

    def _let_go_of_datastore(self) -> Any:
        """The datastore, no longer held by this runtime (the upgrade frees it once mapped)."""
        datastore, self.datastore = self.datastore, None
        return datastore

    def _target(self, strategy: str) -> int:
        """How many samples the datastore may hold after an update by `strategy`."""
        fits = self._max_fit()
        if fits < 1:
            raise BudgetExceeded(
                f"bundle {self.path}: no stored sample fits the budget of "
                f"{self.budget.total} bytes",
                self.manifest.footprint.total,
                self.budget.total,
            )
        target = min(self.capacity, fits) if strategy == "fifo" else fits
        if strategy == "fifo" and target < self.capacity:
            logger.warning(
                "fifo: capacity %d samples does not fit the budget of %d bytes; keeping %d",
                self.capacity,
                self.budget.total,
                target,
            )
        return target

    def _update(
        self,
        z: np.ndarray,
        labels: np.ndarray,
        strategy: str,
        received: int,
        target: int,
        inputs: np.ndarray | None = None,
    ) -> UpdateReport:
        """Evict and add in memory by `strategy` (z: the newest samples it keeps, at most
        `target`; `inputs`: their raw inputs, where the bundle keeps them), then commit; the
        caller holds the lock."""
        ds = self.datastore.sample_store()
        old = len(ds)
        evict = old if received >= target else max(0, old + received - target)
        try:
            ds.evict_oldest(evict)
            if inputs is None:
                ds.add(z, labels)
            else:
                ds.add(z, labels, inputs)
            if strategy == "concatenate" and ds.n is not None and len(ds) > ds.n:
                ds.n = len(ds)
            evict += self._persist()
        except BaseException:
            # The bundle on disk is the last good state; go back to it in memory too.
            try:
                self.datastore = load_bundle_datastore(self.path, self.manifest)
            except BundleError as exc:
                logger.warning("after a failed update, could not reload the datastore: %s", exc)
            raise
        if strategy == "concatenate" and (evict or received > z.shape[0]):
            logger.warning(
                "concatenate: the datastore reached the budget of %d bytes; evicted the %d "
                "oldest samples and now holds %d",
                self.budget.total,
                evict,
                len(ds),
            )
        return self._report(strategy, received, z.shape[0], evict)

    def _report(self, strategy: str, received: int, added: int, evicted: int) -> UpdateReport:
        return UpdateReport(
            strategy,
            received,
            added,
            evicted,
            len(self.datastore.sample_store()),
            self.manifest.footprint.total,
        )

    def _max_fit(self) -> int:
        """The most stored samples whose (estimated) datastore files fit next to the encoder
        (and the refitted head's file, where the bundle refits one)."""
        dim = self.manifest.embedding_dim
        head = head_nbytes(dim, self.num_classes if self._refit_l2() is not None else None)
        return samples_within(self.datastore.sample_store(), dim, self.budget.with_head(head))

    def _refit_l2(self) -> float | None:
        """The l2 an update refits the linear head with; None where it keeps the shipped head
        (see the module docstring)."""
        return self.manifest.refit_l2 if refits(self.datastore) else None

    def _refit(self) -> LinearHead | None:
        l2 = self._refit_l2()
        if l2 is None:
            return None
        with self._blas_threads():
            return refit_head(self.datastore, self.num_classes, l2)

    def _persist(self) -> int:
        """Commit the datastore (and the refitted head); if the real files overshoot the
        budget (estimates for hnsw), evict more of the oldest and retry. Returns how many extra
        samples were evicted. A refitted head goes into the session before this returns."""
        ds, dim, extra = self.datastore.sample_store(), self.manifest.embedding_dim, 0
        for _ in range(8):
            try:
                head = self._refit()
                # the sessions that run the refitted head, or that bake in the samples (see
                # Predictor.baked), are opened and checked before anything is committed: a
                # failure after the commit raised with the samples already stored, and a retry
                # added them twice
                sessions = None
                if head is not None or (self.predictor is not None and self.predictor.baked):
                    model = encoder_model(self.path, self.manifest, head)
                    sessions = open_sessions(
                        model,
                        self.manifest,
                        self.datastore,
                        self.path,
                        intra_op_threads=self._intra_op_threads,
                        with_predictor=self.predictor is not None,
                    )
                    del model
                    check_sessions(*sessions, self.manifest, self.datastore, self.path)
                self.manifest = commit_datastore(self.path, self.manifest, self.datastore, head)
                if sessions is not None:
                    self.encoder, self.predictor = sessions
                return extra
            except BudgetExceeded as exc:
                per_sample = max(1, ds.estimate_nbytes(2, dim) - ds.estimate_nbytes(1, dim))
                more = math.ceil((exc.needed - exc.budget) / per_sample)
                if more >= len(ds):
                    raise
                ds.evict_oldest(more)
                extra += more
        raise BudgetExceeded(
            f"bundle {self.path}: could not fit the updated datastore in the budget",
            0,
            self.budget.total,
        )
