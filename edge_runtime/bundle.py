"""Device bundles (format version 1): read and verify them, write them, commit datastore updates.

A bundle is a directory: manifest.json, encoder.onnx and the datastore files it lists (and,
after a device refitted its linear head, that head's file: edge_runtime.head_file). Every
problem found while reading or writing one is a `BundleError` with a one-line message, and
nothing is written when one is raised.

Crash safety: the manifest is the commit point. A new bundle is written into a temporary sibling
directory and renamed into place; a datastore update writes its files under new names
(datastore.<generation>.npz), then replaces manifest.json atomically, then removes the old files.
A crash at any moment leaves a manifest whose listed files are all complete and verified; files
it does not list (left by an interrupted update) are ignored and removed at the next load or
update.

Concurrency: writers hold an exclusive lock on the bundle directory from reading the manifest to
committing the next one, readers a shared lock while they read (see `locking`), so processes that
share a bundle never lose an update and a reader always sees one complete generation. Writers go
first, through a turnstile: the hidden file `.<bundle>.lock` beside the bundle (in its parent).

Hostile files: the sha256 list guards against corruption, not against someone who rewrites the
manifest too. So every file is also checked for what could crash the process or exhaust memory
before a parser sees it: the manifest's size, nesting and duplicate keys; each file's size
against the budget before it is hashed; npz members (uncompressed, headers matching their
data); hnsw.bin's graph structure; the encoder loaded from the very bytes that were hashed, with
no external data files. A signature (see `signing`) additionally guards the manifest's content.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from zipfile import BadZipFile

import numpy as np

from ._io import (
    fsync_dir,
    fsync_file,
    read_regular,
    sha256_file,
    staging_directory,
    swap_directory,
    swap_target,
    write_bytes_atomic,
    write_json_atomic,
    writer_alive,
)
from .budget import Budget
from .datastores import (
    LOAD_ERRORS,
    file_generation,
    load_datastore,
)
from .encoder import Encoder
from .errors import BudgetExceeded, BundleBusy, BundleError, SignatureError, one_line
from .head_file import (
    head_generation,
    head_score_problem,
    head_tensors,
    load_head,
    read_head,
    refits,
    save_head,
    with_head,
)
from .linear_head import LinearHead
from .locking import DEFAULT_LOCK_TIMEOUT, LockTimeout, directory_lock
from .manifest import (
    ENCODER_FILE,
    MANIFEST,
    UPDATE_STRATEGIES,
    BundleFields,
    Footprint,
    Manifest,
    build_manifest,
    parse_manifest,
    read_manifest,
    read_manifest_bytes,
)
from .onnx_check import uses_external_data
from .predictor import BATCH_ROWS, Predictor
from .preprocess import InputSpec, prepare_input
from .signing import SIGNATURE_FILE, signature_document, verify_signature
from .versions import ModelVersion, encoder_sha256

logger = logging.getLogger(__name__)

__all__ = [
    "ENCODER_FILE",
    "MANIFEST",
    "UPDATE_STRATEGIES",
    "BudgetExceeded",
    "Bundle",
    "BundleBusy",
    "BundleError",
    "SignatureError",
    "read_bundle",
    "read_manifest",
    "write_bundle",
]


@dataclass
class Bundle:
    """A verified bundle: its manifest, the loaded datastore and one onnxruntime session, the
    encoder's or (`read_bundle(with_predictor=True)`, where the datastore has one) the whole
    predictor's, which gives the encoder's outputs too.

    Parameters
    ----------
    path : the bundle's folder.
    manifest : its verified manifest.json.
    encoder : the encoder's onnxruntime session; None when the predictor's session serves.
    datastore : the loaded, verified datastore (flat, HNSW or ProtoNN).
    predictor : the whole predictor's session, when asked for and the datastore has one.
    """

    path: Path
    manifest: Manifest
    encoder: Encoder | None
    datastore: Any
    predictor: Predictor | None = None


# ----------------------------------------------------------------------------- reading


def verify_files(bundle_dir: str | os.PathLike, manifest: Manifest) -> dict[str, int]:
    """Every listed file exists, is a regular file and matches its sha256; the footprint equals
    the file sizes and fits the budget. Returns the sizes."""
    bundle_dir = Path(bundle_dir)
    where = f"bundle {bundle_dir}"
    budget = manifest.budget
    sizes = {}
    for name in manifest.files:
        path = bundle_dir / name
        if path.is_symlink() or not path.is_file():
            raise BundleError(f"{where}: {name} is missing or not a regular file")
        try:
            sizes[name] = path.stat().st_size
        except OSError as exc:
            raise BundleError(f"{where}: cannot read {name}: {exc.strerror}") from None
        if sizes[name] > budget.total:  # never hash a file that cannot fit
            raise BundleError(
                f"{where}: over budget: {name} takes {sizes[name]} bytes > budget_bytes "
                f"{budget.total}"
            )
    for name, digest in manifest.files.items():
        try:
            actual = sha256_file(bundle_dir / name)
        except OSError as exc:
            raise BundleError(f"{where}: cannot read {name}: {exc.strerror}") from None
        if actual != digest:
            raise BundleError(
                f"{where}: {name} does not match its sha256 in the manifest (edited, truncated "
                "or corrupted)"
            )
    footprint = manifest.footprint
    encoder_bytes = sizes[ENCODER_FILE]
    datastore_bytes = sum(sizes[n] for n in manifest.personal_files)
    if footprint.encoder != encoder_bytes or footprint.datastore != datastore_bytes:
        raise BundleError(
            f"{where}: footprint says encoder {footprint.encoder} + datastore "
            f"{footprint.datastore} bytes, the files take {encoder_bytes} + {datastore_bytes}"
        )
    if datastore_bytes > budget.room:
        raise BundleError(
            f"{where}: over budget: encoder {encoder_bytes} + datastore {datastore_bytes} = "
            f"{encoder_bytes + datastore_bytes} bytes > budget_bytes {budget.total}"
        )
    return sizes


def datastore_params(manifest: Manifest) -> dict:
    """Constructor arguments of the manifest's datastore: backend params plus C, k and sigma."""
    return {
        **manifest.params,
        "num_classes": manifest.num_classes,
        "k": manifest.k,
        "sigma": manifest.sigma,
    }


def load_bundle_datastore(bundle_dir: str | os.PathLike, manifest: Manifest):
    """The datastore a (verified) manifest points at."""
    try:
        ds = load_datastore(
            bundle_dir,
            manifest.backend,
            datastore_params(manifest),
            files=manifest.datastore_files,
            embedding_dim=manifest.embedding_dim,
        )
    except LOAD_ERRORS as exc:
        raise BundleError(f"bundle {bundle_dir}: datastore: {one_line(exc)}") from None
    _check_kept_inputs(getattr(ds, "inputs_", None), manifest.input, bundle_dir)
    return ds


def _check_kept_inputs(kept: np.ndarray | None, spec: InputSpec, bundle_dir) -> None:
    """Kept raw inputs are samples of the bundle's input spec (an image of one channel may
    drop its channel axis): the right bytes in another shape failed only when re-embedded or
    added to, naming neither the bundle nor the array."""
    if kept is None:
        return
    dims = spec.shape
    shapes = {dims, dims[:2]} if spec.kind == "image" and dims[-1] == 1 else {dims}
    dtype = np.dtype(spec.dtype)
    if kept.shape[1:] not in shapes or kept.dtype != dtype:
        raise BundleError(
            f"bundle {bundle_dir}: datastore: its kept inputs are {kept.dtype} "
            f"{list(kept.shape[1:])} per sample, the bundle's input {dtype} {list(dims)}"
        )


def read_bundle(
    bundle_dir: str | os.PathLike,
    *,
    intra_op_threads: int | None = None,
    trusted_keys: Sequence[Any] | None = None,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    with_predictor: bool = False,
) -> Bundle:
    """Read and verify a bundle: schema, version, footprint and budget, sha256s, the
    signature when `trusted_keys` are given, the datastore's arrays, and the encoder's output
    sizes (one probe inference on a zero input).

    Reads under a shared lock, so a concurrent update is seen whole or not at all. The only
    write: datastore files no manifest lists (left by a writer that died) are removed.

    Parameters
    ----------
    bundle_dir : the bundle's folder (manifest.json, encoder.onnx, the datastore's files).
    intra_op_threads : onnxruntime's intra-op threads for the encoder session; None lets
        onnxruntime choose.
    trusted_keys : Ed25519 public keys (see `signing`); when given, the manifest must carry a
        valid signature by one of them. None skips the signature check.
    lock_timeout : seconds to wait for the shared lock while a writer holds the bundle
        (BundleBusy after it).
    with_predictor : also build the one-session predictor (`Bundle.predictor`) where the
        datastore has one, from the same verified encoder bytes.

    Returns
    -------
    Bundle : the verified manifest, encoder session, datastore and optional predictor.
    """
    bundle_dir = Path(bundle_dir)
    where = f"bundle {bundle_dir}"
    with bundle_lock(bundle_dir, exclusive=False, timeout=lock_timeout):
        raw = read_manifest_bytes(bundle_dir)
        manifest = parse_manifest(raw, f"{where}: {MANIFEST}")
        if trusted_keys is not None:
            verify_signature(bundle_dir, manifest, trusted_keys, where)
        verify_files(bundle_dir, manifest)
        model = encoder_model(bundle_dir, manifest)
        _remove_stale_quietly(bundle_dir, manifest)
        datastore = load_bundle_datastore(bundle_dir, manifest)
        _check_head_scores(bundle_dir, manifest, datastore)
    encoder, predictor = open_sessions(
        model,
        manifest,
        datastore,
        bundle_dir,
        intra_op_threads=intra_op_threads,
        with_predictor=with_predictor,
    )
    version = encoder_version(model, manifest)
    del model  # the session holds what it needs
    check_sessions(encoder, predictor, manifest, datastore, bundle_dir)
    check_embedding(datastore, version, manifest, where)  # after the encoder's own checks
    return Bundle(bundle_dir, manifest, encoder, datastore, predictor)


def encoder_version(model: bytes, manifest: Manifest) -> ModelVersion:
    """The version of a bundle's encoder (`model`: its verified bytes, a refitted head put in
    or not)."""
    return ModelVersion.of_encoder(model, manifest.files[ENCODER_FILE])


def check_embedding(datastore: Any, encoder: ModelVersion, manifest: Manifest, where: str) -> None:
    """BundleError when the datastore's keys were embedded by another encoder than the
    bundle's (`encoder`), or the manifest's model record names another one."""
    problem = encoder.keys_problem(where, ModelVersion.of_keys(datastore)) or (
        encoder.keys_problem(where, manifest.model, "the manifest says its keys were")
    )
    if problem is not None:
        raise BundleError(problem)


def _check_head_scores(bundle_dir: Path, manifest: Manifest, datastore) -> None:
    """A refitted head's class scores on the samples it was refitted on must stay within
    float32 (head_file.head_score_problem; ProtoNN's Z has the same check)."""
    name = manifest.head_file
    if name is None or not refits(datastore):
        return
    coef, intercept = read_head(bundle_dir / name, manifest.embedding_dim, manifest.num_classes)
    problem = head_score_problem(coef, intercept, datastore.keys())
    if problem:
        raise BundleError(f"bundle {bundle_dir}: {name}: {problem}")


def encoder_model(bundle_dir: Path, manifest: Manifest, head: LinearHead | None = None) -> bytes:
    """The encoder's verified bytes with the linear head a session should run put in: `head`
    (one just refitted, not yet committed), else the refitted head's file the manifest lists,
    else the encoder as exported (edge_runtime.head_file)."""
    where = f"bundle {bundle_dir}"
    model = _read_verified(bundle_dir, ENCODER_FILE, manifest, where)
    name = manifest.head_file
    if head is None and name is None:
        return model
    try:
        if head is not None:
            return with_head(model, head_tensors(head.coef_, head.intercept_))
        tensors = load_head(bundle_dir / name, manifest.embedding_dim, manifest.num_classes)
        return with_head(model, tensors)
    except (ValueError, OSError, EOFError, KeyError, BadZipFile) as exc:
        raise BundleError(
            f"{where}: {name or 'the refitted linear head'}: {one_line(exc)}"
        ) from None


def open_sessions(
    model: bytes,
    manifest: Manifest,
    datastore: Any,
    bundle_dir: Path,
    *,
    intra_op_threads: int | None,
    with_predictor: bool,
) -> tuple[Encoder | None, Predictor | None]:
    """The bundle's one onnxruntime session over `model`: the one-session predictor's
    (`with_predictor`, where the datastore has one), else the encoder's. Check it with
    `check_sessions` once the model's bytes are let go."""
    where = f"bundle {bundle_dir}"
    encoder, predictor = None, None
    try:
        if uses_external_data(model):
            raise ValueError(
                f"{ENCODER_FILE} keeps tensors in external data files; a bundle's encoder must "
                "embed every tensor (the sha256 list does not cover other files)"
            )
        if with_predictor and datastore.single_session():
            predictor = _predictor(model, manifest, datastore, intra_op_threads, where)
        else:
            encoder = Encoder(model, intra_op_threads=intra_op_threads, batch_size=BATCH_ROWS)
    except ValueError as exc:
        raise BundleError(f"{where}: {one_line(exc)}") from None
    return encoder, predictor


def check_sessions(
    encoder: Encoder | None,
    predictor: Predictor | None,
    manifest: Manifest,
    datastore: Any,
    bundle_dir: Path,
) -> None:
    """`open_sessions`' session against the manifest: one probe inference (`check_encoder`)."""
    where = f"bundle {bundle_dir}"
    if predictor is not None:
        check_encoder(lambda raw: predictor.embed(raw, datastore), manifest, where)
    else:
        _check_encoder_alone(encoder, manifest, where)


@contextmanager
def bundle_lock(
    bundle_dir: Path, *, exclusive: bool, timeout: float = DEFAULT_LOCK_TIMEOUT
) -> Iterator[None]:
    """`locking.directory_lock` on a bundle, with its errors (taking the lock, not those of
    the `with` block) as BundleErrors."""
    with ExitStack() as stack:
        try:
            stack.enter_context(directory_lock(bundle_dir, exclusive=exclusive, timeout=timeout))
        except LockTimeout as exc:
            raise BundleBusy(f"bundle {exc}") from None
        except (FileNotFoundError, NotADirectoryError):
            raise BundleError(f"bundle {bundle_dir}: not a directory") from None
        except OSError as exc:
            raise BundleError(f"bundle {bundle_dir}: cannot lock it: {exc.strerror}") from None
        yield


def encoder_bytes(bundle_dir: Path, manifest: Manifest) -> bytes:
    """The encoder file's verified bytes as the bundle shipped it (no refitted head put in)."""
    return _read_verified(bundle_dir, ENCODER_FILE, manifest, f"bundle {bundle_dir}")


def _read_verified(bundle_dir: Path, name: str, manifest: Manifest, where: str) -> bytes:
    """The bytes of a listed file, checked against its sha256 once more: what runs is what
    was hashed, even if the file is swapped after `verify_files`."""
    try:
        data = read_regular(bundle_dir / name, manifest.budget.total)
    except OSError as exc:
        raise BundleError(f"{where}: cannot read {name}: {exc.strerror}") from None
    if data is None or encoder_sha256(data) != manifest.files[name]:
        raise BundleError(f"{where}: {name} changed while it was read")
    return data


def _remove_stale_quietly(bundle_dir: Path, manifest: Manifest) -> None:
    """Leftovers of a dead writer take room past the budget: remove them when loading. Under
    the shared lock no writer is running, so every unlisted datastore file is a leftover."""
    try:
        removed = remove_stale_files(bundle_dir, manifest)
    except OSError as exc:  # a read-only bundle still loads
        logger.warning("bundle %s: could not remove leftover files: %s", bundle_dir, exc)
        return
    if removed:
        logger.warning(
            "bundle %s: removed files of an interrupted update: %s",
            bundle_dir,
            ", ".join(sorted(removed)),
        )


def _predictor(
    model: bytes, manifest: Manifest, datastore: Any, intra_op_threads: int | None, where: str
) -> Predictor:
    """The one-session predictor; when onnxruntime refuses its graph, the encoder alone is
    checked first, so that an encoder that does not match the manifest is named as such."""
    try:
        return Predictor(manifest, datastore, model, intra_op_threads=intra_op_threads)
    except ValueError:
        _check_encoder_alone(Encoder(model, intra_op_threads=1), manifest, where)
        raise


def _check_encoder_alone(encoder: Encoder, manifest: Manifest, where: str) -> None:
    check_encoder(lambda raw: encoder.run(prepare_input(raw, manifest.input)), manifest, where)


def check_encoder(
    embed: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]], manifest: Manifest, where: str
) -> None:
    """One inference (`embed`: raw inputs -> embeddings, logits) on a zero input of the
    manifest's input spec: it must run and give embedding_dim and num_classes outputs."""
    spec = manifest.input
    probe = np.zeros([1, *spec.shape], dtype=spec.dtype)
    try:
        z, logits = embed(probe)
    except ValueError as exc:
        raise BundleError(
            f"{where}: the encoder does not take the manifest's input spec: {one_line(exc)}"
        ) from None
    if z.shape[1] != manifest.embedding_dim or logits.shape[1] != manifest.num_classes:
        raise BundleError(
            f"{where}: the encoder gives embedding dim {z.shape[1]} and {logits.shape[1]} "
            f"classes, the manifest says {manifest.embedding_dim} and "
            f"{manifest.num_classes}"
        )


# ----------------------------------------------------------------------------- writing


def write_bundle(
    out_dir: str | os.PathLike,
    fields: BundleFields,
    encoder: bytes | str | os.PathLike,
    datastore: Any,
    *,
    replace: bool = True,
    signing_key: Any = None,
) -> Manifest:
    """Write a verified bundle to `out_dir` atomically and return its manifest.

    Everything is written into a temporary sibling directory, fsynced, hashed, checked against
    the budget and verified as `read_bundle` would, then renamed into place. An existing bundle
    at `out_dir` is replaced by two renames, old aside then new in, so the window without a
    bundle is two system calls; any other existing non-empty directory is refused. On any
    error nothing is left behind and BundleError (BudgetExceeded when over budget) says why.

    Parameters
    ----------
    out_dir : the bundle's folder; its parent must exist.
    fields : what the writer decides (client, input spec, lambda, budget, update strategy,
        the records of how the kNN setting was chosen and of the model version); the rest
        comes from the datastore and the files written.
    encoder : the ONNX encoder, as bytes or a path to read.
    datastore : a fitted FlatDatastore / HNSWDatastore / ProtoNNDatastore.
    replace : replace a bundle already at `out_dir` (default); False refuses to.
    signing_key : an Ed25519 private key (`signing.load_private_key`) to sign the manifest
        with; None writes an unsigned bundle.

    Returns
    -------
    Manifest : the manifest as written.
    """
    out_dir = Path(out_dir)
    draft = build_manifest(fields, datastore)  # checked before anything is written
    encoder_bytes = _encoder_size(encoder)
    version = _encoder_version(datastore, encoder, out_dir)
    budget = _encoder_within(Budget(draft.budget.total).with_encoder(encoder_bytes), out_dir)
    _check_target(out_dir, replace)
    tmp = staging_directory(out_dir)
    try:
        tmp.mkdir()
        _write_encoder(tmp / ENCODER_FILE, encoder)
        names = _save_stamped(datastore, tmp, version)
        files = {name: sha256_file(tmp / name) for name in (ENCODER_FILE, *names)}
        datastore_bytes = sum((tmp / name).stat().st_size for name in names)
        total = encoder_bytes + datastore_bytes
        if datastore_bytes > budget.room:
            raise BudgetExceeded(
                f"cannot write bundle {out_dir}: encoder {encoder_bytes} + datastore "
                f"{datastore_bytes} = {total} bytes, over the budget of {budget.total} bytes "
                f"(recipe {datastore.recipe}, {len(datastore)} stored)",
                total,
                budget.total,
            )
        manifest = draft.with_datastore(Footprint(encoder_bytes, datastore_bytes, total), files)
        write_json_atomic(tmp / MANIFEST, manifest.to_json())
        trusted = None
        if signing_key is not None:
            signed = (tmp / MANIFEST).read_bytes()
            write_json_atomic(tmp / SIGNATURE_FILE, signature_document(signed, signing_key))
            trusted = [signing_key.public_key()]
        try:
            read_bundle(tmp, intra_op_threads=1, trusted_keys=trusted)
        except BundleError as exc:
            raise BundleError(str(exc).replace(str(tmp), str(out_dir))) from None
        # no device update or load mid-swap
        with bundle_lock(out_dir, exclusive=True) if out_dir.exists() else nullcontext():
            swap_directory(tmp, out_dir)
    except BundleError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BundleError(f"cannot write bundle {out_dir}: {exc}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _encoder_within(budget: Budget, out_dir: Path) -> Budget:
    """`budget`, or BudgetExceeded when its encoder alone is over it."""
    if budget.room < 0:
        raise BudgetExceeded(
            f"cannot write bundle {out_dir}: the encoder alone takes {budget.encoder} bytes, "
            f"over the budget of {budget.total} bytes",
            budget.encoder,
            budget.total,
        )
    return budget


def _check_target(out_dir: Path, replace: bool) -> None:
    """BundleError unless a bundle may be written at `out_dir` (nothing there, or a bundle
    that `replace` lets go) in an existing parent; that parent's abandoned temporaries go."""
    problem = _not_replaceable(swap_target(out_dir))
    if problem:
        raise BundleError(f"refusing to write bundle {out_dir}: {problem}")
    if out_dir.exists() and not replace:
        raise BundleError(f"refusing to replace bundle {out_dir} (replace=False)")
    parent = swap_target(out_dir).parent
    if not parent.is_dir():
        raise BundleError(f"cannot write bundle {out_dir}: {parent} is not a directory")
    remove_abandoned_temporaries(parent)


_ABANDONED_RE = re.compile(r"^\..+\.(?:tmp|old)-(\d+)-[0-9a-f]{8}$")


def remove_abandoned_temporaries(directory: Path) -> list[str]:
    """Remove the temporary directories (.<bundle>.tmp-<pid>-<id>, .<bundle>.old-<pid>-<id>)
    that writers killed mid-write left in `directory`. Only those of processes that no longer
    run: a live writer's temporaries are its own to clean."""
    removed = []
    for entry in directory.iterdir():
        match = _ABANDONED_RE.match(entry.name)
        if match and entry.is_dir() and not entry.is_symlink() and not writer_alive(int(match[1])):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    if removed:
        logger.warning(
            "removed %d directories left by interrupted bundle writes in %s",
            len(removed),
            directory,
        )
    return removed


def _encoder_version(
    datastore: Any, encoder: bytes | str | os.PathLike, out_dir: Path
) -> ModelVersion:
    """The encoder's version (its embedding id); BundleError when the datastore records keys
    another encoder embedded."""
    try:
        model = encoder if isinstance(encoder, bytes) else Path(encoder).read_bytes()
    except OSError as exc:
        raise BundleError(f"cannot read encoder {encoder}: {exc.strerror}") from None
    version = ModelVersion.of_encoder(model)
    problem = version.keys_problem(
        f"cannot write bundle {out_dir}", ModelVersion.of_keys(datastore)
    )
    if problem is not None:
        raise BundleError(problem)
    return version


def _save_stamped(datastore: Any, directory: Path, version: ModelVersion) -> list[str]:
    """Save the datastore recording `version` (its embedding id) in its files. The caller's
    object is left as it was: one fitted on embeddings of unrecorded origin may go into
    several bundles."""
    recorded = getattr(datastore, "embedding_id_", None)
    datastore.embedding_id_ = version.embedding
    try:
        return datastore.save(directory, generation=0)
    finally:
        datastore.embedding_id_ = recorded


def _encoder_size(encoder: bytes | str | os.PathLike) -> int:
    if isinstance(encoder, bytes):
        return len(encoder)
    try:
        return Path(encoder).stat().st_size
    except OSError as exc:
        raise BundleError(f"cannot read encoder {encoder}: {exc.strerror}") from None


def _write_encoder(dest: Path, encoder: bytes | str | os.PathLike) -> None:
    if isinstance(encoder, bytes):
        write_bytes_atomic(dest, encoder, sync_dir=False)
    else:
        shutil.copyfile(encoder, dest)
        fsync_file(dest)


def _not_replaceable(out_dir: Path) -> str | None:
    """Why a bundle cannot be written at `out_dir` (a link's target, `swap_target`; with the
    fix), or None: it is new, empty or a bundle."""
    if not out_dir.exists():
        return None
    if not out_dir.is_dir():
        return "it exists and is not a directory; choose another --out"
    if (out_dir / MANIFEST).is_file() or not any(out_dir.iterdir()):
        return None
    return "it is a directory that holds other files, not a bundle; choose another --out"


# ----------------------------------------------------------------------------- updates

_TMP = r"\.tmp(?:-\d+-[0-9a-f]{8})?"  # a temporary name, old (.tmp) or per writer
_STALE_RE = re.compile(
    rf"^(?:(?:datastore|hnsw|linear_head)(?:\.\d+)?\.(?:npz|bin)(?:{_TMP})?"
    rf"|(?:manifest|signature)\.json{_TMP})$"
)


def remove_stale_files(bundle_dir: str | os.PathLike, manifest: Manifest) -> list[str]:
    """Delete datastore files and temporaries the manifest does not list (left by a crash).
    Call it only under the bundle's lock: then no live writer owns any of them."""
    bundle_dir = Path(bundle_dir)
    removed = []
    for entry in bundle_dir.iterdir():
        if _STALE_RE.match(entry.name) and entry.name not in manifest.files:
            entry.unlink(missing_ok=True)
            removed.append(entry.name)
    if removed:
        fsync_dir(bundle_dir)
    return removed


def commit_datastore(
    bundle_dir: str | os.PathLike,
    manifest: Manifest,
    datastore: Any,
    head: LinearHead | None = None,
) -> Manifest:
    """Persist an updated datastore (and a refitted linear head, `head`; without one the
    bundle keeps the head file it lists, if any) into a bundle crash-safely and return the
    new manifest.

    Order: remove leftovers of interrupted updates; save the datastore and the head under the
    next generation's file names (each written to a temporary name, fsynced, renamed); hash
    them and check the budget (BudgetExceeded, nothing kept); replace manifest.json atomically;
    delete the previous generation's files. The caller holds the bundle's exclusive lock
    (`bundle_lock(..., exclusive=True)`) across its read-modify-commit.
    """
    bundle_dir = Path(bundle_dir)
    if read_manifest(bundle_dir) != manifest:
        raise BundleError(
            f"bundle {bundle_dir}: manifest.json changed on disk since the bundle was loaded "
            "(another writer?); load it again"
        )
    old = manifest.personal_files
    remove_stale_files(bundle_dir, manifest)
    # past every generation the manifest lists, the head's included: a (crafted) manifest
    # listing linear_head.<next>.npz would otherwise have that file overwritten, and a failed
    # commit would leave the bundle unloadable
    kept_head = manifest.head_file
    generation = 1 + max(
        [file_generation(name) for name in manifest.datastore_files]
        + ([head_generation(kept_head)] if kept_head else [])
    )
    names = datastore.save(bundle_dir, generation=generation)
    kept = manifest.head_file
    try:
        if head is not None:
            names.append(save_head(bundle_dir, head, generation))
        elif kept is not None:
            names.append(kept)
        files = {ENCODER_FILE: manifest.files[ENCODER_FILE]}
        files.update({name: sha256_file(bundle_dir / name) for name in names})
        datastore_bytes = sum((bundle_dir / name).stat().st_size for name in names)
        budget = manifest.budget
        total = budget.encoder + datastore_bytes
        if datastore_bytes > budget.room:
            raise BudgetExceeded(
                f"bundle {bundle_dir}: the updated datastore takes {datastore_bytes} bytes; with "
                f"the encoder's {budget.encoder} that is {total}, over the budget of "
                f"{budget.total}",
                total,
                budget.total,
            )
        new = manifest.with_datastore(
            Footprint(budget.encoder, datastore_bytes, total),
            files,
            datastore,
            f"bundle {bundle_dir}: updated manifest",
        )
        write_json_atomic(bundle_dir / MANIFEST, new.to_json())
    except BaseException:
        for name in names:
            if name not in old:
                (bundle_dir / name).unlink(missing_ok=True)
        raise
    for name in old:
        if name not in names:
            (bundle_dir / name).unlink(missing_ok=True)
    fsync_dir(bundle_dir)
    return new
