"""Carry a device's memory to a new model version: `knnper-edge upgrade BUNDLE --to NEW` and
`Runtime.upgrade`.

What the upgraded bundle is made of:
- from the release (the new client bundle NEW): the encoder, the input spec, k, sigma, lambda,
  how they were chosen (knn_choice, lambda_rule) and the model version record;
- from the device (BUNDLE): every stored sample's label, in the same order (oldest first), its
  client id, budget, update strategy and datastore recipe (backend, key dtype, capacity n);
- the keys: re-embedded by the new encoder where the bundle kept its raw inputs (exact), else
  the old keys mapped by the release's key map (edge_runtime.keymap; a per-class map by each
  key's stored label), a chunk at a time, then stored (re-quantized) in the recipe's dtype; an
  HNSW graph is rebuilt on them;
- a linear head refitted on the new keys where the release's bundle refits one;
- the budget checked again with the new encoder's size: the oldest samples that no longer fit
  are evicted, and the report says how many.
A ProtoNN bundle keeps its prototypes where they were trained: the release's reverse map (new
space -> old, shipped beside the forward one, edge_runtime.keymap) is folded into its projection
(ProtoNNDatastore.fold_input_map), so the new encoder's queries are scored exactly as their
mapped-back embeddings would be; its buffer of added samples (already projected) moves with the
prototypes, and the oldest of it is evicted if the new encoder leaves less room. Its shipped
linear head (in the release's encoder) is kept, as `add` keeps it. A release without the reverse
map cannot upgrade it.

Crash and concurrency safety: the upgrade holds the bundle's exclusive lock throughout, writes
the upgraded bundle complete and verified into a temporary sibling directory, then swaps the two
(`_io.swap_directory`, as `write_bundle` does: one atomic step on Linux; elsewhere two renames
under the lock; a link at the path is kept, its directory replaced). Killed at any instant, the
path holds the old bundle or the new one, each complete; the leftover temporary is removed by
the next write beside it.
Signed: a bundle the exporter signed takes the release's signature.json with it, and must stay
what the release signed in everything an update cannot change (otherwise the upgrade is
refused), and is refused an unsigned release (it would lose its signature). A bundle the device
built itself (`init`: its recipe and lambda its own) was never signed and is not after an upgrade
either; the release it upgrades to is verified all the same when keys are given (the CLI's
`upgrade --release-key`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._io import read_within, staging_directory, swap_directory
from .budget import Budget
from .bundle import (
    ENCODER_FILE,
    BudgetExceeded,
    BundleError,
    commit_datastore,
    encoder_bytes,
    encoder_version,
    load_bundle_datastore,
    read_bundle,
    write_bundle,
)
from .datastores import BACKENDS, format_recipe
from .device_choice import InitSettings, choose_datastore
from .encoder import Encoder
from .errors import SignatureError, one_line
from .head_file import head_nbytes, refit_head, samples_within
from .keymap import ADVICE, MAX_MAP_BYTES, KeyMap, load_key_map
from .manifest import Manifest
from .preprocess import prepare_input
from .release import bundle_name
from .signing import SIGNATURE_FILE, check_signed_base, verify_file
from .versions import ModelVersion

UPGRADES_DIR = "upgrades"
# the validation share lambda is re-chosen on from kept inputs: `knnper-edge init`'s default
REEMBED_VAL_FRACTION = 0.2
_HOW = {
    "folded": "buffered; the release's reverse map folded into the ProtoNN projection, "
    "the prototypes kept"
}


def map_file_name(old: ModelVersion) -> str:
    """Where a release keeps the map from an older encoder: upgrades/from-<id12>.npz."""
    return f"from-{old.short}.npz"


@dataclass
class UpgradeReport:
    """What one upgrade did."""

    from_version: ModelVersion
    to_version: ModelVersion
    how: str  # "mapped" | "re-embedded" | "folded" (protonn) | "nothing to do"
    carried: int
    evicted: int
    lam: float
    footprint_bytes: int
    evidence: str = ""
    signed: bool = False

    def lines(self) -> list[str]:
        out = [
            f"version       {self.from_version.describe()} -> {self.to_version.describe()}",
            f"samples       {self.carried} carried ({_HOW.get(self.how, self.how)})"
            + (
                f", {self.evicted} oldest evicted: the new encoder leaves less room"
                if self.evicted
                else ""
            ),
            f"lambda        {self.lam:g} ("
            + (
                "chosen on the kept inputs by the release's rule)"
                if self.how == "re-embedded" and not self.signed
                else "the release's)"
            ),
            f"footprint     {self.footprint_bytes} bytes"
            + (", signed by the release" if self.signed else ""),
        ]
        if self.evidence:
            out.append(f"evidence      {self.evidence}")
        return out


def upgrade_bundle(
    path: Path,
    manifest: Manifest,
    datastore: Any,
    new_dir: str | os.PathLike,
    *,
    key_map: str | os.PathLike | None = None,
    trusted_keys: Any = None,
    force: bool = False,
) -> UpgradeReport:
    """Upgrade the bundle at `path` to the version of the release bundle `new_dir`, in place
    (see the module docstring for what the upgraded bundle is made of).

    Parameters
    ----------
    path : the device's bundle; the caller holds its exclusive lock.
    manifest : its manifest, as loaded.
    datastore : its datastore, as loaded; the caller holds no other reference to it (it is let
        go once its keys are carried over, so the old and new keys are not held together).
    new_dir : the release's bundle for this client (NEW/client_NNNN).
    key_map : the release's map file; None is NEW's parent's upgrades/from-<id>.npz.
    trusted_keys : Ed25519 public keys the release (and its map) must be signed with.
    force : apply the map even where the release advises to keep the old keys or start fresh,
        and go back to an older version of the same lineage (a downgrade, refused without it).

    Returns
    -------
    UpgradeReport : the versions from and to, how the samples went over, how many were
        carried and evicted, the lambda and the footprint.

    Raises
    ------
    BundleError : one line, before anything is written: another client's bundle of the release
        (forced or not), another number of classes, a downgrade, a read-only or signed bundle
        the release cannot keep so, no usable map; BudgetExceeded where the new encoder
        leaves no room.
    """
    where = f"bundle {path}"
    new_dir = Path(new_dir)
    release = read_bundle(new_dir, intra_op_threads=1, trusted_keys=trusted_keys).manifest
    _check_same_client(where, manifest, release, new_dir)
    if release.num_classes != manifest.num_classes:
        raise BundleError(
            f"{where}: the release {new_dir} has {release.num_classes} "
            f"classes, this bundle {manifest.num_classes}: not an upgrade of it"
        )
    model = encoder_bytes(new_dir, release)
    new, encoder_size = release.model or encoder_version(model, release), len(model)
    # written from its file, not held: the written bundle is checked against `new` again
    del model
    old = (
        manifest.model
        or ModelVersion.of_keys(datastore)
        or encoder_version(encoder_bytes(path, manifest), manifest)
    )
    count = len(datastore.sample_store())
    report = UpgradeReport(
        old, new, "nothing to do", count, 0, manifest.lam, manifest.footprint.total
    )
    if old.matches(new):
        return report
    if new.older_than(old) and not force:
        raise BundleError(
            f"{where} is {old.describe()} and the release {new_dir} is the older "
            f"{new.describe()}: a downgrade; --force goes back to it"
        )
    plan = _Plan(
        path, manifest, new_dir, release, new, count, _keeps_signature(where, path, new_dir)
    )
    report.how, report.evidence = _carrying(plan, datastore, old, key_map, force, trusted_keys)
    plan.datastore = datastore
    del datastore  # the plan owns it now, and lets it go once its keys are carried over
    evict = _room(plan, encoder_size)
    written, evict = _write_upgraded(plan, evict, trusted_keys)
    report.evicted, report.carried = evict, count - evict
    report.lam, report.footprint_bytes = written.lam, written.footprint.total
    report.signed = plan.signed
    return report


@dataclass
class _Plan:
    """One upgrade as decided before anything is written: the device's bundle and the
    release's, how the samples go over, and the datastore they go into."""

    path: Path
    manifest: Manifest
    new_dir: Path
    release: Manifest
    new: ModelVersion
    count: int  # the samples the bundle stores now
    signed: bool  # the bundle takes the release's signature
    mapping: KeyMap | None = None  # None: the kept raw inputs are re-embedded
    map_path: Path | None = None
    datastore: Any = None  # the old keys (folded, for ProtoNN), until carried over
    params: dict = field(default_factory=dict)  # the upgraded datastore's parameters
    fresh: Any = None  # an empty datastore of the upgraded recipe: what estimates are asked of
    l2: float | None = None  # the linear head's l2, where the release refits one
    budget: Budget | None = None

    @property
    def where(self) -> str:
        return f"bundle {self.path}"

    @property
    def trained(self) -> bool:
        """A ProtoNN-like bundle: its prototypes stay, the release's reverse map folded in."""
        return BACKENDS[self.manifest.backend].TRAINED

    @property
    def dim(self) -> int:
        return self.release.embedding_dim


def _keeps_signature(where: str, path: Path, new_dir: Path) -> bool:
    """Whether the upgraded bundle takes the release's signature (both are signed); refused
    where the bundle cannot be written, or is signed and the release is not."""
    if not os.access(path, os.W_OK):  # its swapped-out copy could not be removed: left behind
        raise BundleError(f"{where} is read-only: make it writable to upgrade it, as to add to it")
    signed = (new_dir / SIGNATURE_FILE).is_file() and (path / SIGNATURE_FILE).is_file()
    if (path / SIGNATURE_FILE).is_file() and not signed:  # lost, and not back until a next version
        raise BundleError(
            f"{where} is signed and the release {new_dir} is not: the upgrade would drop its "
            f"signature; upgrade to the signed release (or delete {SIGNATURE_FILE} to take it)"
        )
    return signed


def _carrying(
    plan: _Plan,
    datastore: Any,
    old: ModelVersion,
    key_map: str | os.PathLike | None,
    force: bool,
    trusted_keys: Any,
) -> tuple[str, str]:
    """How the samples go over: "re-embedded" from the raw inputs the bundle kept, else by the
    release's key map (`plan.mapping`), "mapped" or, for ProtoNN, "folded"; with the map's
    evidence. Refused in one line where neither is possible."""
    where, manifest, release = plan.where, plan.manifest, plan.release
    if getattr(datastore, "inputs_", None) is not None:
        if release.input != manifest.input:
            raise BundleError(
                f"{where}: the release {plan.new_dir} takes other inputs than the ones "
                "this bundle kept; it cannot re-embed them"
            )
        return "re-embedded", ""
    plan.mapping, plan.map_path = _key_map(
        plan.new_dir, old, plan.new, key_map, manifest, release, where, force, trusted_keys
    )
    if plan.trained and plan.mapping.reverse_weight is None:
        raise BundleError(
            f"{where}: the release's map ({plan.mapping.describe()}) lacks the reverse map "
            f"a {manifest.backend} bundle is upgraded with: install the release's own "
            f"bundle {plan.new_dir} instead"
        )
    return ("folded" if plan.trained else "mapped"), plan.mapping.describe()


def _room(plan: _Plan, encoder_size: int) -> int:
    """Fill in the upgraded datastore (its parameters, an empty one to estimate with, the
    head's l2, the budget after the new encoder and head; a ProtoNN datastore folded) and
    return how many of the oldest samples must go to fit; BudgetExceeded where not one fits."""
    release = plan.release
    plan.params = {
        **plan.manifest.params,
        "num_classes": release.num_classes,
        "k": release.k,
        "sigma": release.sigma,
    }
    if plan.trained:  # the folded datastore is small: its buffer is what an eviction takes from
        try:
            plan.datastore = plan.datastore.fold_input_map(
                plan.mapping.reverse_weight,
                plan.mapping.reverse_bias,
                k=release.k,
                sigma=release.sigma,
            )
        except ValueError as exc:
            raise BundleError(
                f"{plan.where}: folding the release's reverse map: {one_line(exc)}"
            ) from None
        plan.fresh = plan.datastore.sample_store()  # a protonn bundle keeps its shipped head
    else:
        plan.fresh = BACKENDS[plan.manifest.backend].from_params(plan.params)
        plan.l2 = release.refit_l2
    budget = Budget(plan.manifest.budget.total, encoder_size).with_head(
        head_nbytes(plan.dim, release.num_classes if plan.l2 is not None else None)
    )
    plan.budget = budget
    fits = samples_within(plan.fresh, plan.dim, budget)
    # a protonn bundle's prototypes stay with an empty buffer too
    if fits < 1 and (
        not plan.trained or plan.fresh.estimate_nbytes(0, plan.dim) > budget.sample_room
    ):
        raise BudgetExceeded(
            f"{plan.where}: the new encoder ({encoder_size} bytes) leaves no room for "
            f"{'its folded prototypes' if plan.trained else 'one stored sample'} in the "
            f"budget of {budget.total} bytes",
            encoder_size,
            budget.total,
        )
    return max(0, plan.count - fits)


def _write_upgraded(plan: _Plan, evict: int, trusted_keys: Any) -> tuple[Manifest, int]:
    """Write the upgraded bundle complete and verified beside the old one, then swap the two
    directories: (its manifest, how many of the oldest samples it evicted). An estimate that
    undershot (HNSW) evicts a few more and writes again; the old keys are let go before the
    new bundle is written and checked."""
    release, manifest = plan.release, plan.manifest
    fields = release.upgraded_fields(manifest)
    tmp = staging_directory(plan.path)
    try:
        for _ in range(8):
            ds, lam = _carried(plan, evict)
            try:
                written = write_bundle(
                    tmp, dataclasses.replace(fields, lam=lam), plan.new_dir / ENCODER_FILE, ds
                )
                break
            except BudgetExceeded as exc:  # estimates (hnsw) undershot: evict a little more
                per = max(
                    1,
                    plan.fresh.estimate_nbytes(2, plan.dim)
                    - plan.fresh.estimate_nbytes(1, plan.dim),
                )
                most = plan.count if plan.trained else plan.count - 1  # protonn may buffer none
                if evict >= most:
                    raise
                evict = min(most, evict + max(1, (exc.needed - exc.budget) // per + 1))
        else:
            raise BudgetExceeded(
                f"{plan.where}: the upgraded datastore does not fit the budget",
                0,
                plan.budget.total,
            )
        if plan.l2 is not None:
            head = refit_head(ds, release.num_classes, plan.l2)
            written = commit_datastore(tmp, written, ds, head)
        if plan.signed:
            shutil.copyfile(plan.new_dir / SIGNATURE_FILE, tmp / SIGNATURE_FILE)
            if trusted_keys is not None:
                read_bundle(tmp, intra_op_threads=1, trusted_keys=trusted_keys)
            else:
                check_signed_base(tmp, written, f"the upgraded {plan.where}")
        swap_directory(tmp, plan.path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return written, evict


def _carried(plan: _Plan, evict: int) -> tuple[Any, float]:
    """The upgraded datastore without the `evict` oldest samples: the folded one's buffer cut,
    or the keys mapped or re-embedded into a fresh one; with its lambda (the release's, or the
    one chosen on the kept inputs). The old keys are let go once carried over (a retry reads
    them again from the bundle on disk)."""
    lam = plan.release.lam
    if plan.trained:  # the folded datastore, its buffer down to the newest count - evict
        store = plan.datastore
        ds = store.evict_oldest(len(store.sample_store()) - (plan.count - evict))
    else:
        if plan.datastore is None:  # a retry: the old keys again, from the bundle on disk
            plan.datastore = load_bundle_datastore(plan.path, plan.manifest)
        if plan.mapping is None:
            model = encoder_bytes(plan.new_dir, plan.release)
            ds, chosen = _reembedded(
                plan.datastore, evict, model, plan.release, plan.params, plan.manifest
            )
            lam = plan.release.lam if plan.signed else chosen
        else:
            ds = _mapped(
                plan.datastore,
                evict,
                plan.mapping,
                plan.params,
                plan.manifest.backend,
                plan.where,
                plan.map_path,
            )
        plan.datastore = None  # the old keys go before the new bundle is written and checked
    ds.embedding_id_ = plan.new.embedding
    return ds, lam


def _check_same_client(where: str, manifest: Manifest, release: Manifest, new_dir: Path) -> None:
    """BundleError when the release bundle is another client's: its lambda (and a refitted
    head) are that client's, chosen on that client's data. A device that never trained
    (client id -1, built by `init`) takes any client's bundle of the release."""
    device, other = manifest.client_id, release.client_id
    if device >= 0 and other >= 0 and device != other:
        raise BundleError(
            f"{where} is client {device}'s and the release bundle {new_dir} is client "
            f"{other}'s: upgrade it with client {device}'s bundle of the release "
            f"({new_dir.parent / bundle_name(device)})"
        )


def _mapped(
    datastore: Any,
    evict: int,
    mapping: KeyMap,
    params: dict,
    backend: str,
    where: str,
    map_path: Path,
) -> Any:
    """The samples from the `evict`-th oldest on, their keys mapped a chunk at a time and
    stored a chunk at a time (`fit_chunks`): what is held beside the two datastores is a few
    chunks, not the mapped keys in float32. A finite map may still take keys past float32's
    range (a key or its squared norm): refused naming the bundle and the map."""
    kept = len(datastore) - evict

    def checked(chunk: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore"):
            if not np.isfinite(np.einsum("ij,ij->i", chunk, chunk)).all():
                raise BundleError(
                    f"{where}: the key map {map_path} takes its keys out of float32's range: "
                    "not a map for them; use the map the release ships for this bundle"
                )
        return chunk

    def chunks():
        return map(
            checked,
            mapping.chunks(
                lambda a, b: datastore.key_rows(evict + a, evict + b),
                kept,
                datastore.labels_[evict:],
            ),
        )

    return BACKENDS[backend].from_params(params).fit_chunks(chunks, kept, datastore.labels_[evict:])


def _reembedded(
    datastore: Any, evict: int, model: bytes, release: Manifest, params: dict, manifest: Manifest
) -> tuple[Any, float]:
    """The samples from the `evict`-th oldest on, re-embedded from their kept raw inputs by
    the new encoder (in the encoder's own batches), with lambda chosen as `init --like
    RELEASE` would choose it on them (device_init.choose_datastore): (datastore, lambda)."""
    inputs, labels = datastore.inputs_[evict:], datastore.labels_[evict:]
    encoder = Encoder(model)
    zs, logits = [], []
    for start in range(0, len(labels), encoder.batch_size):
        z, lg = encoder.run(
            prepare_input(inputs[start : start + encoder.batch_size], release.input)
        )
        zs.append(z)
        logits.append(lg)
    recipe = format_recipe(manifest.backend, params)
    final, best, _ = choose_datastore(
        np.concatenate(zs),
        np.concatenate(logits),
        labels,
        [recipe],
        InitSettings(
            k=release.k,
            sigma=release.sigma,
            val_fraction=REEMBED_VAL_FRACTION,
            client_id=manifest.client_id,
            lambda_rule=release.lambda_rule,
        ),
        inputs,
    )
    return final, float(best["lambda"])


def _key_map(
    new_dir: Path,
    old: ModelVersion,
    new: ModelVersion,
    given: str | os.PathLike | None,
    manifest: Manifest,
    release: Manifest,
    where: str,
    force: bool,
    trusted_keys: Any = None,
) -> tuple[KeyMap, Path]:
    path = (
        Path(given) if given is not None else (new_dir.parent / UPGRADES_DIR / map_file_name(old))
    )
    if given is None and not path.is_file():
        raise BundleError(
            f"{where}: its keys were embedded by encoder {old.short} and the release ships "
            f"no map from it ({path} is missing): pass the release's map with --map, or build "
            "a fresh bundle with `knnper-edge init --like NEW_BUNDLE`"
        )
    if trusted_keys is not None:  # a signed release's map is signed with it
        verify_file(
            path,
            read_within(path, MAX_MAP_BYTES, lambda why: SignatureError(f"key map {path}: {why}")),
            trusted_keys,
        )
    try:
        mapping = load_key_map(path)
    except (ValueError, OSError) as exc:
        raise BundleError(one_line(exc)) from None
    if not (mapping.from_version.matches(old) and mapping.to_version.matches(new)):
        raise BundleError(
            f"key map {path} maps encoder {mapping.from_version.short} -> "
            f"{mapping.to_version.short}, this upgrade needs {old.short} -> "
            f"{new.short}: use the map the release ships for this bundle's version"
        )
    if mapping.weight.shape != (manifest.embedding_dim, release.embedding_dim):
        raise BundleError(
            f"key map {path} is {list(mapping.weight.shape)}, this upgrade needs "
            f"[{manifest.embedding_dim}, {release.embedding_dim}]"
        )
    classes = mapping.extra.get("class_weight", np.zeros((manifest.num_classes,))).shape[0]
    if classes != manifest.num_classes:
        raise BundleError(
            f"key map {path} is per-class for {classes} classes, this bundle has "
            f"{manifest.num_classes}: use the map the release ships for this bundle's version"
        )
    if mapping.advice != ADVICE[0] and not force:
        raise BundleError(
            f"{where}: the release advises to {mapping.advice} rather than map "
            f"the keys ({mapping.describe()}); --force maps them anyway"
        )
    return mapping, path
