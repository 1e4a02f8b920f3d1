"""From a finished run to one device bundle per client: export and quantize the encoder once,
embed each client's data with it as the device will, size each client's datastore to its budget,
and write the bundles plus an export.json summary."""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import as_completed
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge_runtime._io import (
    remove_dead_writers_files,
    to_json_types,
    write_bytes_atomic,
    write_json_atomic,
)
from edge_runtime.budget import Budget
from edge_runtime.bundle import (
    BundleError,
    SignatureError,
    remove_abandoned_temporaries,
    sha256_file,
)
from edge_runtime.datastores import BACKENDS
from edge_runtime.encoder import Encoder, optimize_encoder
from edge_runtime.knn import LAMBDA_ESTIMATORS, NORMALIZATIONS, base_problem
from edge_runtime.locking import LockTimeout, directory_lock
from edge_runtime.manifest import read_manifest
from edge_runtime.personal_head import ClientSplits
from edge_runtime.preprocess import InputSpec, raw_checked
from edge_runtime.release import (
    RELEASE_FILE,
    Release,
    ReleaseError,
    bundle_name,
    read_release,
    write_release,
)
from edge_runtime.signing import load_private_key, sign_file
from edge_runtime.upgrade import UPGRADES_DIR
from edge_runtime.versions import ModelVersion, encoder_sha256
from export.client_export import (
    ClientTask,
    SizingContext,
    export_client,
    export_client_in_worker,
    init_worker,
)
from export.errors import BudgetInvalid, ExportError
from export.journal import ExportJournal
from export.onnx_export import encoder_nbytes_floor, export_onnx
from export.options import DEVICE_EXTRAS, backend_choices
from export.personal_encoder import with_linear_head
from export.quantize import QUANTIZE_MODES, calibration_inputs, quantize_int8
from export.resume import bundle_problem, row_problem
from export.sizing import SearchSpace, smallest_datastore_bytes
from fed_train.algorithms.base import ClientData, embed_and_logits
from fed_train.client_files import client_split
from fed_train.knn_setting import KNNChoice
from fed_train.progress import Progress
from fed_train.run import MODEL_FILE, LoadedRun
from fed_train.workers import worker_pool

log = logging.getLogger(__name__)

ENCODER_FILE = "encoder.onnx"
FP32_ENCODER_FILE = "encoder.fp32.onnx"
JOURNAL_FILE = "export.journal.jsonl"
UPDATE_STRATEGIES = ("fifo", "concatenate", "fixed")


@dataclass
class ExportSettings:
    """How bundles are made; everything else comes from the run.

    Parameters
    ----------
    quantize : the shipped encoder's weights: "int8" (default) or "fp32".
    backend : "auto" (every registered backend is a candidate; each client keeps the best
        on its validation split that fits its budget) or one registered backend ("flat",
        "hnsw", "protonn", ...).
    knn : kNN-Per as every bundle runs it, with where each value came from (`KNNChoice`; in
        every manifest and export.json): its normalisation is baked into the encoder's
        "embedding" output, and with the linear base each client's linear head ships as its
        encoder's classifier (export.personal_encoder).
    update_strategy : what `Runtime.add` does on the device: "fifo", "concatenate" or
        "fixed".
    device_extras : "any", or "none" for only the backends the runtime alone loads (no
        hnswlib on the device).
    protonn_buffer : share of a client's train samples a protonn bundle reserves room for, as
        its buffer of samples learned on the device (none with update_strategy "fixed").
    calibration_samples : training inputs int8 quantization calibrates on.
    seed : seeds calibration's sample and the datastore sizing.
    space : the configurations tried per client (`export.sizing.SearchSpace`).
    signing_key : an Ed25519 private key file (PEM) that signs every bundle; None: unsigned.
    keep_inputs : every bundle keeps its stored samples' raw inputs beside their keys, counted
        in its budget, so `knnper-edge upgrade` re-embeds them exactly (flat and HNSW only:
        "auto" leaves ProtoNN out).
    """

    quantize: str = "int8"
    backend: str = "auto"
    knn: KNNChoice = field(default_factory=KNNChoice)
    update_strategy: str = "fifo"
    device_extras: str = "any"
    protonn_buffer: float = 0.1
    calibration_samples: int = 256
    seed: int = 0
    space: SearchSpace = field(default_factory=SearchSpace)
    signing_key: str | None = None
    keep_inputs: bool = False

    def check(self) -> None:
        _check_known("quantization", self.quantize, QUANTIZE_MODES)
        _check_known("backend", self.backend, backend_choices())
        _check_known("device extras", self.device_extras, DEVICE_EXTRAS)
        if self.device_extras == "none" and device_extra(self.backend):
            raise ExportError(
                f"--backend {self.backend} needs the {device_extra(self.backend)} "
                "extra on the device; --device-extras none rules it out"
            )
        _check_known("update strategy", self.update_strategy, UPDATE_STRATEGIES)
        if self.keep_inputs and self.backend != "auto" and BACKENDS[self.backend].TRAINED:
            raise ExportError(
                f"--keep-inputs keeps raw inputs beside stored samples, and a {self.backend} "
                "datastore stores trained prototypes instead: use --backend "
                + ", ".join(b for b, cls in BACKENDS.items() if not cls.TRAINED)
                + " or auto"
            )
        knn, config = self.knn, self.knn.config
        _check_known("embedding normalisation", config.normalize, NORMALIZATIONS)
        _check_known("lambda estimator", knn.lambda_estimator, LAMBDA_ESTIMATORS)
        problem = base_problem(knn.base, knn.l2)
        if problem is not None:
            raise ExportError(problem)
        if config.k < 1 or not config.sigma > 0:
            raise ExportError(
                f"k must be >= 1 and sigma > 0, got k={config.k}, sigma={config.sigma}"
            )
        if self.calibration_samples < 1:
            raise ExportError("calibration_samples must be >= 1")
        if self.signing_key is not None:
            try:
                load_private_key(self.signing_key)
            except SignatureError as err:
                raise ExportError(str(err)) from None

    def to_dict(self, space: SearchSpace) -> dict[str, Any]:
        """What export.json and the journal's fingerprint record: every setting, the kNN
        choice's values one by one with their provenance, and the space as searched."""
        knn = self.knn
        values = {
            **knn.config.to_dict(),
            "lambda_estimator": knn.lambda_estimator,
            "lambda_rule": asdict(knn.lambda_rule),
            "base": knn.base,
            "l2": knn.l2,
            "knn_provenance": knn.provenance(),
        }
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "knn":
                out.update(values)
            else:
                out[f.name] = asdict(space) if f.name == "space" else getattr(self, f.name)
        return out


def _check_known(what: str, value: str, known: Sequence[str]) -> None:
    if value not in known:
        raise ExportError(f"unknown {what} {value!r}; known: {', '.join(known)}")


def apply_knn_choice(settings: ExportSettings, choice: KNNChoice) -> ExportSettings:
    """These settings running `choice`, with where each value came from for the manifests."""
    return replace(settings, knn=choice)


@dataclass
class EncoderFiles:
    """The exported encoder(s) in the output directory and what was measured on them."""

    path: Path  # what ships in every bundle
    fp32_path: Path
    quantize: str
    nbytes: int
    fp32_nbytes: int
    torch_max_abs_diff: float
    int8_vs_fp32: dict[str, float] = field(default_factory=dict)


def select_ids(unseen: Sequence[bool], which: str) -> list[int]:
    """Client ids for "all", "seen" (took part in training), "unseen" (held out) or
    "ID,ID,..."; `unseen` holds one flag per client of the run."""
    which = which.strip()
    ids = list(range(len(unseen)))
    if which == "all":
        return ids
    if which in ("seen", "unseen"):
        chosen = [i for i in ids if bool(unseen[i]) == (which == "unseen")]
        if not chosen:
            raise ExportError(f"the run has no {which} clients")
        return chosen
    out: list[int] = []
    for token in which.split(","):
        try:
            cid = int(token)
        except ValueError:
            raise ExportError(
                f"--clients takes all, seen, unseen or a comma-separated list of "
                f"client ids, got {which!r}"
            ) from None
        if not 0 <= cid < len(ids):
            raise ExportError(
                f"client {cid} is not in the run (it has clients 0 to {len(ids) - 1})"
            )
        if cid not in out:
            out.append(cid)
    return out


def select_clients(clients: Sequence[ClientData], which: str) -> list[ClientData]:
    """The clients `select_ids` names, in its order."""
    return [clients[i] for i in select_ids([c.unseen for c in clients], which)]


def build_encoder(
    run: LoadedRun,
    directory: Path,
    settings: ExportSettings,
    clients: Sequence[ClientData] | None = None,
) -> EncoderFiles:
    """Export fp32 ONNX into `directory` (checked against torch), then quantize to int8 when
    asked. Calibration uses a seeded sample of the training clients' train splits: server-side
    data, never a test split, never an unseen client's data.

    Parameters
    ----------
    run : the finished run (`load_run`) whose global model is exported.
    directory : an existing folder for the fp32 and the device encoder's .onnx files.
    settings : `ExportSettings`: its quantize ("int8" or "fp32"), calibration_samples, seed and
        kNN-Per's normalization are read here.
    clients : run.clients(), when the caller has them already (preparing them costs a pass
        over the data set); None prepares them.

    Returns
    -------
    EncoderFiles : both files' paths and sizes (bytes) and their measured differences (fp32
        against torch, int8 against fp32).
    """
    clients = run.clients() if clients is None else clients
    calibration = calibration_inputs(clients, settings.calibration_samples, settings.seed)
    fp32_path, path = directory / FP32_ENCODER_FILE, directory / ENCODER_FILE
    diff = export_onnx(run.model, calibration, fp32_path, normalize=settings.knn.config.normalize)
    if settings.quantize == "int8":
        quantize_int8(fp32_path, path, calibration)
    else:
        shutil.copyfile(fp32_path, path)
    # saved as onnxruntime optimizes it, so a device creates its session with optimization off
    write_bytes_atomic(path, optimize_encoder(path.read_bytes()))
    files = EncoderFiles(
        path, fp32_path, settings.quantize, path.stat().st_size, fp32_path.stat().st_size, diff
    )
    if settings.quantize == "int8":
        files.int8_vs_fp32 = compare_encoders(fp32_path, path, _validation_inputs(clients))
    return files


def _move_encoder(files: EncoderFiles, out_dir: Path) -> EncoderFiles:
    """Move the encoder files into out_dir (each replaced atomically; on a full disk nothing
    is left behind)."""
    moved = {}
    for attr in ("path", "fp32_path"):
        src: Path = getattr(files, attr)
        write_bytes_atomic(out_dir / src.name, src.read_bytes())
        moved[attr] = out_dir / src.name
    return replace(files, **moved)


def _validation_inputs(clients: Sequence[ClientData], limit: int = 1024) -> np.ndarray:
    pools = [c.x_val.cpu().numpy() for c in clients if not c.unseen and len(c.y_val)]
    if not pools:
        pools = [c.x_train.cpu().numpy() for c in clients if not c.unseen]
    return np.concatenate(pools)[:limit]


def compare_encoders(reference: Path, other: Path, x: np.ndarray) -> dict[str, float]:
    """How far the int8 encoder is from fp32 on server-side validation inputs."""
    z0, l0 = Encoder(reference, intra_op_threads=1).run(x)
    z1, l1 = Encoder(other, intra_op_threads=1).run(x)
    norms = np.linalg.norm(z0, axis=1) * np.linalg.norm(z1, axis=1)
    ok = norms > 0
    cosine = (z0 * z1).sum(axis=1)[ok] / norms[ok]
    return {
        "samples": int(len(x)),
        "embedding_cosine_min": float(cosine.min()) if ok.any() else 1.0,
        "embedding_cosine_mean": float(cosine.mean()) if ok.any() else 1.0,
        "logits_max_abs_diff": float(np.abs(l0 - l1).max()),
        "argmax_agreement": float(np.mean(l0.argmax(1) == l1.argmax(1))),
    }


def client_embeddings(encoder: Encoder, client: ClientData, *, test: bool = False) -> ClientSplits:
    """The client's splits through the exported encoder in onnxruntime, as the device computes
    them: what is stored is what the device will query with. The test split only if asked."""
    if client.num_train == 0:
        raise ExportError(
            f"client {client.client_id} has no training samples to build a datastore from"
        )

    def split(x: torch.Tensor, y: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (*encoder.run(x.cpu().numpy()), y.cpu().numpy())

    return ClientSplits.from_logits(
        client.client_id,
        client.unseen,
        split(client.x_train, client.y_train),
        split(client.x_val, client.y_val) if len(client.y_val) else None,
        split(client.x_test, client.y_test) if test and len(client.y_test) else None,
    )


def bundle_dir(out_dir: Path, client_id: int) -> Path:
    return out_dir / bundle_name(client_id)


BUNDLE_DIR_RE = re.compile(r"client_[0-9]{4,}")


def export_run(
    run: LoadedRun,
    out_dir: str | Path,
    budgets: Mapping[int, Budget | int],
    settings: ExportSettings | None = None,
    *,
    clients: str = "all",
    encoder: EncoderFiles | None = None,
    progress: bool = True,
    workers: int | None = 1,
    force: bool = False,
    replaces: dict | None = None,
    warn_extras: bool = True,
) -> dict[str, Any]:
    """Write one bundle per selected client into out_dir and return the export report (every
    client's choice and every candidate tried; also written as out_dir/export.json). Each
    bundle is written atomically by edge_runtime's write_bundle (temporary directory, then
    rename): an interrupted export leaves complete bundles and nothing half-written that loads.

    Resumable: each finished client is recorded in out_dir/export.journal.jsonl, and a re-run
    with the same run, settings and encoder skips clients whose bundle exists for the same
    budget; leftover temporary bundle directories are removed.

    One release per folder: out_dir/export.json is written first, as the release's record
    (edge_runtime.release), before any bundle. An out_dir holding another release (another
    model version, or a record that cannot be read) is refused (ExportError) before anything
    is written, unless `force`; so is a bundle that `add` has taught since it was exported, the
    rule `knnper-edge init --out` keeps: replacing it loses what its device learned.

    Parameters
    ----------
    run : a finished run (`fed_train.load_run`).
    out_dir : the folder the bundles (`client_NNNN/`), export.json and the journal go to.
    budgets : each client's Budget, by client id, as export.profiles makes them (a plain
        number of bytes is a budget of that total).
    settings : quantization, backends, kNN-Per's configuration...; None is the defaults.
    clients : "all", "seen", "unseen" or "ID,ID,...", as `knnper export --clients`.
    encoder : files from an earlier `build_encoder` with the same settings, reused
        (benchmarks export many times from one run).
    progress : a bar on a terminal, a line every 30 s in a log.
    workers : processes sizing clients in parallel; None is one per usable core.
    force : replace another release in out_dir whole, and bundles that `add` has taught
        since they were exported.
    replaces : the model version record (`model_record`) of the release these bundles
        replace, written into every manifest.
    """
    settings = settings or ExportSettings()
    settings.check()
    space = _search_space(settings, run)
    out_dir = Path(out_dir)
    every_client = run.clients()
    chosen = select_clients(every_client, clients)
    budgets = _chosen_budgets(chosen, budgets)
    if encoder is None:
        refuse_budgets_below_encoder(run, budgets, settings.quantize)
    _refuse_non_directory(out_dir)  # before the encoder is built
    with tempfile.TemporaryDirectory(prefix="knnper-encoder-") as tmp:
        encoder_files = _encoder_files(encoder, run, Path(tmp), settings, every_client)
        budgets = _client_budgets(budgets, encoder_files, run, space, settings)  # before writing
        if warn_extras:  # off where one process exports the same space again (the demo)
            _warn_device_extras(space)
        release = _release(run, encoder_files, replaces, chosen)
        out_dir.mkdir(parents=True, exist_ok=True)
        with _exclusive(out_dir):
            _claim(out_dir, release, force)
            return _export_locked(
                run,
                out_dir,
                budgets,
                settings,
                space,
                _move_encoder(encoder_files, out_dir),
                chosen,
                progress,
                workers,
                release,
            )


def _encoder_files(
    given: EncoderFiles | None,
    run: LoadedRun,
    tmp: Path,
    settings: ExportSettings,
    every_client: list[ClientData],
) -> EncoderFiles:
    """The given encoder files (ExportError unless of the settings' quantization), or ones
    built into `tmp`."""
    files = given or build_encoder(run, tmp, settings, every_client)
    if files.quantize != settings.quantize:
        raise ExportError(
            f"the given encoder is {files.quantize}, the settings ask for {settings.quantize}"
        )
    return files


def _release(
    run: LoadedRun, encoder: EncoderFiles, replaces: dict | None, chosen: list[ClientData]
) -> Release:
    """The record of the release this export makes (edge_runtime.release)."""
    return Release(
        str(run.run_dir),
        ModelVersion.from_record(model_record(run, encoder.path), replaces),
        tuple(c.client_id for c in chosen),
        run.config.continue_from,
    )


def _refuse_non_directory(out_dir: Path) -> None:
    existing = next(p for p in (out_dir, *out_dir.parents) if p.exists())
    if not existing.is_dir():
        raise ExportError(f"--out {out_dir}: {existing} exists and is not a directory")


def _search_space(settings: ExportSettings, run: LoadedRun) -> SearchSpace:
    """The datastores the settings let a client's search try: the backend asked for, no
    ProtoNN buffer for a bundle that never adds, no device extras when refused, and raw inputs
    kept where asked."""
    space = replace(
        settings.space.restricted_to(settings.backend),
        protonn_buffer=0.0 if settings.update_strategy == "fixed" else settings.protonn_buffer,
    )
    if settings.device_extras == "none":
        space = replace(space, backends=tuple(b for b in space.backends if not device_extra(b)))
    return _keeping_inputs(space, run) if settings.keep_inputs else space


def _chosen_budgets(
    chosen: list[ClientData], budgets: Mapping[int, Budget | int]
) -> dict[int, Budget]:
    """Each chosen client's Budget; ExportError for a client without training samples,
    BudgetInvalid for one without a budget."""
    for client in chosen:
        if client.num_train == 0:
            raise ExportError(
                f"client {client.client_id} has no training samples to build a datastore from"
            )
        if client.client_id not in budgets:
            raise BudgetInvalid(f"no budget for client {client.client_id}")
    return {c.client_id: _as_budget(c.client_id, budgets[c.client_id]) for c in chosen}


def _sign_shared_encoder(path: Path, signing_key: str | None) -> None:
    """The shared encoder, which a new device builds its bundle on (`knnper-edge init --like`,
    a node of `knnper deploy release`), signed as the key maps are (PATH.sig.json): with the
    linear base a client's bundle carries its own encoder, so no bundle's signature covers
    this one. Unsigned exports leave no signature of an earlier one behind."""
    if signing_key is None:
        Path(f"{path}.sig.json").unlink(missing_ok=True)
    else:
        sign_file(path, load_private_key(signing_key))


def _keeping_inputs(space: SearchSpace, run: LoadedRun) -> SearchSpace:
    """The space whose datastores keep each stored sample's raw input; backends that store
    no samples (ProtoNN) are left out, with one line saying so."""
    trained = [b for b in space.backends if BACKENDS[b].TRAINED]
    if trained:
        log.warning("--keep-inputs: %s datastores keep no samples, left out", ", ".join(trained))
    one = raw_checked(run.dataset.x_train[:1], run.dataset.input_spec)
    return replace(
        space,
        backends=tuple(b for b in space.backends if b not in trained),
        inputs=int(one[0].nbytes),
    )


def _claim(out_dir: Path, release: Release, force: bool) -> None:
    """Make out_dir `release`'s folder, writing its record first (the caller holds the
    folder's lock). Another release there (or a record that cannot be read) is refused, and a
    bundle of this one that `add` taught, unless `force`: the other release is then removed
    whole (its bundles, journal and key maps, its record last), the taught bundle replaced."""
    try:
        held, damaged = read_release(out_dir), None
    except ReleaseError as err:
        held, damaged = None, f"an export.json that records no release ({err})"
    other = damaged or (
        None
        if held is None or held.same_version(release)
        else f"another release: {held.model.describe()}, exported from {held.run}"
    )
    if other is not None and not force:
        raise ExportError(
            f"--out {out_dir} holds {other}; this export is {release.model.describe()}: "
            "export into another --out, or add --force to replace that release whole"
        )
    if other is not None:
        _remove_release(out_dir)
    elif not force:
        _refuse_taught(out_dir, release.clients)
    write_release(out_dir, release)


def _remove_release(out_dir: Path) -> None:
    """Remove what a release wrote into out_dir: its bundles (client_NNNN), journal and key
    maps; its record and shared encoder are replaced by the next one's."""
    for entry in out_dir.iterdir():
        if entry.name in (JOURNAL_FILE, UPGRADES_DIR) or BUNDLE_DIR_RE.fullmatch(entry.name):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()


def _refuse_taught(out_dir: Path, client_ids: Sequence[int]) -> None:
    """ExportError when a bundle this export would write over was taught by `add` (a manifest
    that cannot be read is rebuilt, as before)."""
    taught = []
    for cid in client_ids:
        try:
            if read_manifest(bundle_dir(out_dir, cid)).taught_on_device:
                taught.append(bundle_dir(out_dir, cid).name)
        except BundleError:
            continue
    if taught:
        shown = ", ".join(taught[:5]) + (" ..." if len(taught) > 5 else "")
        raise ExportError(
            f"--out {out_dir} holds {len(taught)} bundle(s) that `knnper-edge "
            f"add` taught since they were exported ({shown}); export into "
            "another --out, or add --force to replace them (they lose what "
            "their devices learned)"
        )


def _warn_device_extras(space: SearchSpace) -> None:
    """Say before any bundle is written that some may need more than the runtime alone: the
    README's device install has no extras, and a bundle it cannot load is found on the device."""
    for backend in space.backends:
        if device_extra(backend):
            log.warning(
                "%s datastores are among those tried: a client whose most accurate "
                "datastore is %s gets a bundle that a device loads only with the %s "
                "extra and that `knnper-edge export-onnx` cannot turn into one ONNX "
                "file (export.json names each client's backend); --device-extras none "
                "leaves %s out",
                backend,
                backend,
                device_extra(backend),
                backend,
            )


def device_extra(backend: str) -> str | None:
    """The extra a device installs to load bundles of `backend` (its class's DEVICE_EXTRA;
    None: the runtime alone loads them, or "auto", which is no backend)."""
    cls = BACKENDS.get(backend)
    return None if cls is None else cls.DEVICE_EXTRA


def needing_extras(rows: Sequence[dict[str, Any]]) -> dict[str, list[int]]:
    """Per backend that needs a device extra: the clients whose bundle has it."""
    found: dict[str, list[int]] = {}
    for r in rows:
        if device_extra(r["backend"]):
            found.setdefault(r["backend"], []).append(int(r["client_id"]))
    return found


@contextmanager
def _exclusive(out_dir: Path) -> Iterator[None]:
    """One export at a time per --out: two would mix their bundles and export.json. The lock
    is flock(2) on the directory, released by the kernel if the export dies."""
    with ExitStack() as stack:
        try:
            stack.enter_context(directory_lock(out_dir, exclusive=True, timeout=0))
        except LockTimeout:
            raise ExportError(
                f"--out {out_dir} is in use by another export; wait for it to "
                "finish or choose another directory"
            ) from None
        yield


def _export_locked(
    run: LoadedRun,
    out_dir: Path,
    budgets: dict[int, Budget],
    settings: ExportSettings,
    space: SearchSpace,
    encoder_files: EncoderFiles,
    chosen: list[ClientData],
    progress: bool,
    workers: int | None,
    release: Release,
) -> dict[str, Any]:
    """The shared encoder's signature, the bundles and export.json, while this process holds
    out_dir's lock."""
    _sign_shared_encoder(encoder_files.path, settings.signing_key)
    model, lineage = release.model.to_record(), release.model.replaces
    replaces = None if lineage is None else lineage.to_record()
    context = SizingContext(
        encoder_files.path,
        run.dataset.num_classes,
        settings.knn,
        space,
        settings.seed,
        settings.update_strategy,
        settings.signing_key,
        out_dir / JOURNAL_FILE,
        release.model,
    )
    remove_stale_temporaries(out_dir)
    done = ExportJournal(context.journal).finished(
        _fingerprint(run, settings, space, encoder_files),
        budgets,
        _resumable(out_dir, run, settings, encoder_files),
    )
    todo = [c for c in chosen if c.client_id not in done]
    if done:
        log.info(
            "resuming: %d of %d client(s) already exported", len(chosen) - len(todo), len(chosen)
        )
    session = Encoder(encoder_files.path, intra_op_threads=1)
    tasks = (_client_task(run, c, session, encoder_files, settings, budgets, out_dir) for c in todo)
    # a client's sizing time grows with its train split: the estimate is per sample
    work = {c.client_id: max(1, c.num_train) for c in todo}
    with Progress(
        len(chosen),
        desc=f"export {out_dir.name}",
        unit="client",
        enabled=progress,
        initial=len(chosen) - len(todo),
        total_work=sum(work.values()),
    ) as bar:
        for row in _export_clients(tasks, len(todo), context, workers):
            done[row["client_id"]] = row
            bar.update(work[row["client_id"]])
    rows = [done[c.client_id] for c in chosen]
    report = {
        "run": release.run,
        "settings": settings.to_dict(space),
        "knn": settings.knn.provenance(),
        "encoder": {
            "file": encoder_files.path.name,
            "quantize": encoder_files.quantize,
            "bytes": encoder_files.nbytes,
            "fp32_file": encoder_files.fp32_path.name,
            "fp32_bytes": encoder_files.fp32_nbytes,
            "torch_max_abs_diff": encoder_files.torch_max_abs_diff,
            "int8_vs_fp32": encoder_files.int8_vs_fp32,
            "calibration": "seeded sample of the training clients' train splits",
        },
        "model": model,
        **({"replaces": replaces} if replaces is not None else {}),
        **({"continues": release.continues} if release.continues is not None else {}),
        "clients": rows,
    }
    write_json_atomic(out_dir / RELEASE_FILE, report)
    return report


def model_record(run: LoadedRun, encoder: Path) -> dict[str, Any]:
    """The model version the bundles are built from, as each manifest records it: the run,
    its last round, the sha256 of its weights file and the encoder's embedding id."""
    return ModelVersion(
        ModelVersion.of_encoder(encoder.read_bytes()).embedding,
        run.run_dir.name,
        int(run.config.training.rounds),
        sha256_file(run.run_dir / MODEL_FILE),
    ).to_record()


def _client_task(
    run: LoadedRun,
    client: ClientData,
    session: Encoder,
    encoder_files: EncoderFiles,
    settings: ExportSettings,
    budgets: dict[int, Budget],
    out_dir: Path,
) -> ClientTask:
    """One client's sizing input: its embeddings from the exported encoder and, with the linear
    base, its own encoder (its linear head as the classifier), whose logits the sizer's lambda
    is chosen against, as the device will compute them."""
    personal = _personal_encoder(run, client, encoder_files.path, settings)
    budget = budgets[client.client_id]
    if personal is not None:
        session = Encoder(personal, intra_op_threads=1)
        budget = budget.with_encoder(len(personal))
    inputs = None
    if settings.keep_inputs:  # as the device receives them, in the order of x_train
        x, _ = client_split(run, client.client_id, "train")
        inputs = raw_checked(x, run.dataset.input_spec)
    return ClientTask(
        client_embeddings(session, client),
        budget,
        client.unseen,
        bundle_dir(out_dir, client.client_id),
        InputSpec(run.dataset.input_spec),
        personal,
        inputs,
    )


def _personal_encoder(
    run: LoadedRun, client: ClientData, encoder: Path, settings: ExportSettings
) -> bytes | None:
    """With the linear base, the client's own encoder: its linear head, fitted with the chosen
    l2 on the server's float embeddings of its train split (normalised as the kNN's, as the
    server's evaluation fits it), in place of the global classifier. None otherwise."""
    knn = settings.knn
    if knn.base != "linear":
        return None
    z_train, _ = embed_and_logits(run.model, client.x_train)
    head = knn.head(run.dataset.num_classes).fit_linear(z_train, client.y_train.cpu().numpy())
    return with_linear_head(encoder, head)


def _resumable(
    out_dir: Path, run: LoadedRun, settings: ExportSettings, encoder: EncoderFiles
) -> Callable[[int, dict[str, Any]], bool]:
    """Whether a journaled client can be skipped: its row is well formed and its bundle is
    still the one the row describes, with this command's settings and encoder (the client's
    own, with the linear base), else it is rebuilt."""
    trusted = (
        [load_private_key(settings.signing_key).public_key()] if settings.signing_key else None
    )
    input_spec = to_json_types(run.dataset.input_spec)
    shared_sha256 = encoder_sha256(encoder.path.read_bytes())
    clients: dict[int, ClientData] = {}

    def client_encoder_sha256(cid: int) -> str:
        if settings.knn.base != "linear":
            return shared_sha256
        if not clients:
            clients.update((c.client_id, c) for c in run.clients())
        return encoder_sha256(_personal_encoder(run, clients[cid], encoder.path, settings))

    def keep(cid: int, row: dict[str, Any]) -> bool:
        problem = row_problem(row)
        if problem is None:
            expected = {
                "client_id": cid,
                "input": input_spec,
                "k": settings.knn.config.k,
                "sigma": float(settings.knn.config.sigma),
                "update_strategy": settings.update_strategy,
            }
            problem = bundle_problem(
                bundle_dir(out_dir, cid), row, expected, trusted, client_encoder_sha256(cid)
            )
        if problem is not None:
            log.warning("client %d: rebuilding its bundle: %s", cid, problem)
        return problem is None

    return keep


def _as_budget(client_id: int, budget: Budget | int) -> Budget:
    """A client's budget as given to export_run: a Budget, or a number of bytes as its total."""
    try:
        return budget if isinstance(budget, Budget) else Budget(budget)
    except ValueError as err:
        raise BudgetInvalid(f"client {client_id}: {err}") from None


def refuse_budgets_below_encoder(
    run: LoadedRun, budgets: Mapping[int, Budget], quantize: str
) -> None:
    """BudgetInvalid when some budget is below the fewest bytes the run's encoder can take
    (`encoder_nbytes_floor`): checked from the model's weights alone, before the encoder is
    exported and, in `knnper export`, before the kNN setting is chosen (minutes)."""
    floor = encoder_nbytes_floor(run.model, quantize)
    below = [cid for cid, budget in budgets.items() if budget.total < floor]
    if below:
        raise _refusal(
            below,
            budgets,
            f"is below the size of the {quantize} encoder alone (at least {floor} bytes, "
            "counting its weights alone)",
        )


def _refusal(too_small: list[int], budgets: Mapping[int, Budget], why: str) -> BudgetInvalid:
    """One line naming the first client whose budget is too small, and how many others are."""
    cid = too_small[0]
    others = f" (and {len(too_small) - 1} other client(s))" if len(too_small) > 1 else ""
    return BudgetInvalid(f"client {cid}: budget {budgets[cid].total} bytes {why}{others}")


def _client_budgets(
    budgets: dict[int, Budget],
    encoder: EncoderFiles,
    run: LoadedRun,
    space: SearchSpace,
    settings: ExportSettings,
) -> dict[int, Budget]:
    """Each client's budget with the encoder in it. Refused before writing any bundle when
    some budget cannot hold the encoder, or cannot hold the encoder plus the smallest datastore
    the search (`space`) allows."""
    smallest_datastore = smallest_datastore_bytes(
        space,
        run.dataset.num_classes,
        int(run.model.embedding_dim),
        run.dataset.num_classes if settings.knn.base == "linear" else None,
    )
    out = {cid: budget.with_encoder(encoder.nbytes) for cid, budget in budgets.items()}
    below = [cid for cid, budget in out.items() if budget.room < 0]
    if below:
        raise _refusal(
            below,
            out,
            f"is below the size of the {encoder.quantize} encoder alone ({encoder.nbytes} bytes)",
        )
    tight = [cid for cid, budget in out.items() if budget.room < smallest_datastore]
    if tight:
        raise _refusal(
            tight,
            out,
            f"cannot hold the {encoder.quantize} encoder ({encoder.nbytes} "
            f"bytes) plus the smallest datastore ({smallest_datastore} bytes): the smallest "
            f"budget that fits is {encoder.nbytes + smallest_datastore} bytes",
        )
    return out


def _export_clients(
    tasks: Iterator[ClientTask], count: int, context: SizingContext, workers: int | None
) -> Iterator[dict[str, Any]]:
    """Each client's row as it finishes: in this process, or in a pool of worker processes."""
    workers = min(workers or usable_cores(), count)
    if workers <= 1:
        sizer = context.sizer()
        for task in tasks:
            yield export_client(task, context, sizer)
        return
    with worker_pool(workers, init_worker, (context,)) as pool:
        futures = [pool.submit(export_client_in_worker, task) for task in tasks]
        for future in as_completed(futures):
            yield future.result()


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _fingerprint(
    run: LoadedRun, settings: ExportSettings, space: SearchSpace, encoder: EncoderFiles
) -> dict[str, Any]:
    """What makes two exports the same export: the run, every setting, the encoder's bytes."""
    return to_json_types(
        {
            "run": str(Path(run.run_dir).resolve()),
            "settings": settings.to_dict(space),
            "encoder_sha256": encoder_sha256(encoder.path.read_bytes()),
        }
    )


def remove_stale_temporaries(out_dir: Path) -> None:
    """Temporary bundle directories that an interrupted export left behind (write_bundle
    renames its temporary directory into place only once the bundle is complete); those of
    an export still running into the same directory are left to it; and the temporary files
    of killed writers (the journal's, export.json's)."""
    remove_abandoned_temporaries(out_dir)
    remove_dead_writers_files(out_dir)
