"""The bundle manifest (format version 1): its schema, parsing (bounded, no duplicate keys, no
NaN constants, limited nesting), validation, and building one from caller fields and a fitted
datastore. Both `bundle` (reading and writing bundles) and `signing` (checking a signed
manifest against the current one) import it, so neither imports the other."""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import numpy as np

from ._io import parse_json, read_within, to_json_types
from .budget import Budget
from .datastores import BACKENDS, DATASTORE_FILE_RE, format_recipe, parse_recipe
from .datastores.common import file_generation
from .errors import BundleError
from .head_file import HEAD_FILE_RE
from .knn import CLIENT_RULE, LambdaRule, k_sigma_problem
from .knn_provenance import KNNProvenance
from .preprocess import InputSpec
from .values import is_integer, is_real
from .versions import ModelVersion

FORMAT = "knnper-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ENCODER_FILE = "encoder.onnx"
UPDATE_STRATEGIES = ("fifo", "concatenate", "fixed")

_INT = "int"
_NUM = "number"
# Required manifest keys and their JSON types, in the order they are checked.
_SCHEMA: dict[str, str | type] = {
    "client_id": _INT,
    "input": dict,
    "num_classes": _INT,
    "embedding_dim": _INT,
    "k": _INT,
    "sigma": _NUM,
    "lambda": _NUM,
    "backend": dict,
    "update_strategy": str,
    "budget_bytes": _INT,
    "footprint": dict,
    "files": dict,
}
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_FILE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# A real manifest is about 1 KB; these bound what a hostile one can cost to parse.
MAX_MANIFEST_BYTES = 64 * 1024
MAX_MANIFEST_DEPTH = 8
# Most classes and embedding dimensions a bundle may declare: every prediction allocates arrays
# this wide, so a hostile manifest must not choose their size freely.
MAX_WIDTH = 1 << 16


def _type_ok(value: Any, kind: str | type) -> bool:
    if kind == _INT:
        return is_integer(value)
    if kind == _NUM:
        return is_real(value, finite=True)
    return isinstance(value, kind)


def _type_name(kind: str | type) -> str:
    return kind if isinstance(kind, str) else {dict: "object", str: "string"}[kind]


def validate_manifest(manifest: Any, where: str = "manifest.json") -> dict:
    """Check format, version, required keys, their types and ranges; BundleError if not."""

    def fail(problem: str) -> BundleError:
        return BundleError(f"{where}: {problem}")

    if not isinstance(manifest, dict):
        raise fail("must be a JSON object")
    if manifest.get("format") != FORMAT:
        raise fail(f"'format' must be {FORMAT!r}, got {manifest.get('format')!r}")
    version = manifest.get("version")
    if not is_integer(version) or version < 1:
        raise fail(f"'version' must be a positive integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise fail(f"newer format version {version}, this runtime reads {FORMAT_VERSION}")
    for key, kind in _SCHEMA.items():
        if key not in manifest:
            raise fail(f"missing key {key!r}")
        if not _type_ok(manifest[key], kind):
            raise fail(f"{key!r} must be a JSON {_type_name(kind)}, got {manifest[key]!r}")
    try:
        InputSpec(manifest["input"])
    except ValueError as exc:
        raise fail(f"'input': {exc}") from None
    for key in ("num_classes", "embedding_dim", "k", "budget_bytes"):
        if manifest[key] < 1:
            raise fail(f"{key!r} must be >= 1, got {manifest[key]}")
    for key in ("num_classes", "embedding_dim"):  # sizes of what predictions allocate
        if manifest[key] > MAX_WIDTH:
            raise fail(f"{key!r} is {manifest[key]}, over the {MAX_WIDTH} this runtime takes")
    problem = k_sigma_problem(manifest["k"], manifest["sigma"])
    if problem:
        raise fail(problem)
    if not 0.0 <= manifest["lambda"] <= 1.0:
        raise fail(f"'lambda' must be in [0, 1], got {manifest['lambda']}")
    _validate_backend(manifest, fail)
    strategy = manifest["update_strategy"]
    if strategy not in UPDATE_STRATEGIES:
        raise fail(f"'update_strategy' must be one of {list(UPDATE_STRATEGIES)}, got {strategy!r}")
    footprint = manifest["footprint"]
    for key in ("encoder", "datastore", "total"):
        if not is_integer(footprint.get(key)) or footprint[key] < 0:
            raise fail(f"'footprint' needs a non-negative integer {key!r}")
    if footprint["total"] != footprint["encoder"] + footprint["datastore"]:
        raise fail("'footprint' total is not encoder + datastore")
    _validate_files(manifest["files"], manifest["backend"]["name"], fail)
    if "knn_choice" in manifest:
        try:
            choice = KNNProvenance(manifest["knn_choice"])
        except ValueError as exc:
            raise fail(str(exc)) from None
        if choice.k.value != manifest["k"] or choice.sigma.value != manifest["sigma"]:
            raise fail("'knn_choice' disagrees with the bundle's k or sigma")
    if "lambda_rule" in manifest:
        _lambda_rule(manifest, fail)
    for key in Manifest.RECORDS:  # the version built from ("model"), the one it replaces
        if key in manifest:
            try:
                ModelVersion.parse(manifest[key], key)
            except ValueError as exc:
                raise fail(str(exc)) from None
    return manifest


# A lambda grid longer than this is not one a server chooses from (LAMBDA_GRID has 7 values).
MAX_LAMBDA_GRID = 64


def _lambda_rule(manifest: dict, fail) -> LambdaRule:
    """The manifest's pooled lambda rule (LambdaRule.to_dict()'s data: what `init --like`
    chooses a new device's lambda with), checked before anything is built from it."""
    rule = manifest["lambda_rule"]
    if not isinstance(rule, dict) or sorted(rule) != ["grid", "name", "pooled", "prior_samples"]:
        raise fail("'lambda_rule' must be an object with keys name, pooled, prior_samples, grid")
    grid, pooled = rule["grid"], rule["pooled"]

    def numbers(values: Any) -> bool:
        return isinstance(values, list) and all(is_real(v, finite=True) for v in values)

    if (
        not numbers(grid)
        or not 1 <= len(grid) <= MAX_LAMBDA_GRID
        or not isinstance(pooled, list)
        or len(pooled) not in (0, len(grid))
        or not all(numbers(r) and len(r) == 3 for r in pooled)
        or not isinstance(rule["name"], str)
    ):
        raise fail(
            f"'lambda_rule' needs a grid of 1 to {MAX_LAMBDA_GRID} numbers and a "
            "(correct, log-loss sum, samples) row of numbers per grid value"
        )
    if not is_real(rule["prior_samples"], finite=True):
        raise fail("'lambda_rule' 'prior_samples' must be a finite number (a sample count)")
    try:
        parsed = LambdaRule.from_dict(rule)
    except ValueError as exc:
        raise fail(f"'lambda_rule': {exc}") from None
    named = manifest.get("knn_choice", {}).get("lambda_rule", {}).get("value", parsed.name)
    if named != parsed.name:
        raise fail(f"'lambda_rule' is {parsed.name!r} but 'knn_choice' says {named!r}")
    return parsed


def _validate_backend(manifest: dict, fail) -> None:
    backend = manifest["backend"]
    name = backend.get("name")
    if name not in BACKENDS:
        raise fail(f"backend 'name' must be one of {sorted(BACKENDS)}, got {name!r}")
    if not isinstance(backend.get("params"), dict):
        raise fail("backend 'params' must be a JSON object")
    recipe = backend.get("recipe")
    if not isinstance(recipe, str):
        raise fail("backend 'recipe' must be a string")
    try:
        recipe_name, _ = parse_recipe(recipe)
    except ValueError as exc:
        raise fail(f"backend 'recipe': {exc}") from None
    if recipe_name != name:
        raise fail(f"backend recipe {recipe!r} is not a {name} recipe")
    try:
        spelled = format_recipe(name, backend["params"])
    except (ValueError, TypeError):
        raise fail(f"backend 'params' are not {name} recipe parameters") from None
    if recipe != spelled:  # what `info` shows is what the (signed) params say
        raise fail(f"backend recipe {recipe!r} does not match its params ({spelled!r})")


def _validate_files(files: dict, backend: str, fail) -> None:
    for name, digest in files.items():
        if not _FILE_NAME_RE.match(name) or name == MANIFEST:
            raise fail(f"'files' lists an invalid file name {name!r}")
        if not isinstance(digest, str) or not _SHA256_RE.match(digest):
            raise fail(f"'files' entry {name!r} is not a lowercase hex sha256")
        if (
            name != ENCODER_FILE
            and not HEAD_FILE_RE.match(name)
            and not (DATASTORE_FILE_RE.match(name) and not name.endswith(".tmp"))
        ):
            raise fail(
                f"'files' lists {name!r}, which is neither the encoder, a refitted "
                "linear head nor a datastore file"
            )
    if ENCODER_FILE not in files:
        raise fail(f"'files' does not list {ENCODER_FILE}")
    if len([n for n in files if HEAD_FILE_RE.match(n)]) > 1:
        raise fail("'files' lists more than one linear head file")
    stored = _datastore_names(files)
    layout = BACKENDS[backend].FILES
    want = (sum(n.endswith(".npz") for n in layout), sum(n.endswith(".bin") for n in layout))
    got = (
        sum(n.endswith(".npz") for n in stored),
        sum(n.endswith(".bin") for n in stored),
    )
    if got != want:
        raise fail(
            f"a {backend} bundle lists {want[0]} .npz and {want[1]} .bin datastore file(s), "
            f"got {stored}"
        )


def _datastore_names(files: dict) -> list[str]:
    return sorted(n for n in files if n != ENCODER_FILE and not HEAD_FILE_RE.match(n))


class Footprint(NamedTuple):
    """A bundle's bytes: its encoder's file, its personal files' (the datastore's and a
    refitted head's), and both."""

    encoder: int
    datastore: int
    total: int


@dataclass(frozen=True)
class Manifest:
    """A bundle's validated manifest.json: what code reads of a bundle, as attributes; `json`
    is the object as read (or written), so that it is written back in the same bytes. Parse
    one with `parse_manifest` / `read_manifest`; never build one from unchecked data.

    The field policy: what a writer decides is `BundleFields` (`write_bundle` derives the
    rest); RECORDS are the model version's records; DEVICE what an on-device update may change
    in a signed bundle (signing); a bundle built from a release (`upgrade`) takes the release's
    records (`upgraded_fields`)."""

    json: dict[str, Any]
    format_version: int = field(init=False)  # of the bundle format, FORMAT_VERSION or older
    client_id: int = field(init=False)
    input: InputSpec = field(init=False)  # what the encoder takes (edge_runtime.preprocess)
    num_classes: int = field(init=False)
    embedding_dim: int = field(init=False)
    k: int = field(init=False)
    sigma: float = field(init=False)
    lam: float = field(init=False)
    update_strategy: str = field(init=False)
    backend: str = field(init=False)  # the datastore's (edge_runtime.datastores)
    recipe: str = field(init=False)
    budget: Budget = field(init=False)
    footprint: Footprint = field(init=False)
    # the version it was built from, with the one it replaces as its lineage; None before
    # versions
    model: ModelVersion | None = field(init=False)
    # where k, sigma, the normalisation and the lambda estimator came from; None in a bundle
    # that records none
    knn_choice: KNNProvenance | None = field(init=False)

    RECORDS: ClassVar = ("model", "replaces")
    DEVICE: ClassVar = ("files", "footprint", "backend")

    def to_json(self) -> dict[str, Any]:
        """A copy of the object to write (json.dumps of it gives the manifest's bytes)."""
        return copy.deepcopy(self.json)

    def __post_init__(self) -> None:
        j, backend = self.json, self.json["backend"]
        fields = {
            "format_version": j["version"],
            "client_id": j["client_id"],
            "input": InputSpec(j["input"]),
            "num_classes": j["num_classes"],
            "embedding_dim": j["embedding_dim"],
            "k": j["k"],
            "sigma": j["sigma"],
            "lam": float(j["lambda"]),
            "update_strategy": j["update_strategy"],
            "backend": backend["name"],
            "recipe": backend["recipe"],
            "budget": Budget(j["budget_bytes"], j["footprint"]["encoder"]),
            "footprint": Footprint(**j["footprint"]),
            "model": ModelVersion.from_record(j.get("model"), j.get("replaces")),
            "knn_choice": KNNProvenance(j["knn_choice"]) if "knn_choice" in j else None,
        }
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    @property
    def params(self) -> dict[str, Any]:
        """The datastore's recipe parameters (what `format_recipe` spells)."""
        return dict(self.json["backend"]["params"])

    @property
    def files(self) -> dict[str, str]:
        """Every file the bundle holds but the manifest, with its sha256."""
        return dict(self.json["files"])

    @property
    def datastore_files(self) -> list[str]:
        """The datastore's files (everything listed but the encoder and a head)."""
        return _datastore_names(self.json["files"])

    @property
    def head_file(self) -> str | None:
        """The device's refitted linear head's file (edge_runtime.head_file), if it has one."""
        return next((n for n in self.json["files"] if HEAD_FILE_RE.match(n)), None)

    @property
    def personal_files(self) -> list[str]:
        """What an on-device update rewrites and the footprint's datastore share counts: the
        datastore's files and the refitted head's."""
        return sorted(n for n in self.json["files"] if n != ENCODER_FILE)

    @property
    def taught_on_device(self) -> bool:
        """Whether `add` has updated the bundle since it was written: an update writes the
        next generation's datastore files (datastore.<n>.npz), which an export never does."""
        return any(file_generation(name) > 0 for name in self.datastore_files)

    def upgraded_fields(self, device: Manifest) -> BundleFields:
        """The fields of `device`'s bundle upgraded to this release bundle: the device's client,
        budget and update strategy; the release's input spec, lambda, how its kNN setting was
        chosen (knn_choice, lambda_rule) and its model version."""
        return BundleFields(
            device.client_id,
            self.input,
            self.lam,
            device.budget.total,
            device.update_strategy,
            self.knn_choice,
            self.lambda_rule,
            self.model,
        )

    @property
    def normalize(self) -> str | int | float | None:
        """How embeddings are normalised before the kNN ("none", "l2"); None where the
        bundle records no choice."""
        return None if self.knn_choice is None else self.knn_choice.normalize.value

    @property
    def base(self) -> str:
        """What the kNN is interpolated with: "global" (the encoder's classifier) or "linear"
        (the client's own head)."""
        base = None if self.knn_choice is None else self.knn_choice.base
        return "global" if base is None else str(base.value)

    @property
    def refit_l2(self) -> float | None:
        """The l2 a device refits its linear head with after `add`: the exporter's, recorded
        with the linear base; None for a bundle interpolating with the global model."""
        l2 = None if self.knn_choice is None else self.knn_choice.l2
        return None if self.base != "linear" or l2 is None else float(l2.value)

    @property
    def lambda_rule(self) -> LambdaRule:
        """How the bundle's lambda was chosen from validation evidence: its pooled rule, or
        each client's own evidence (the paper's) where it records none."""
        return _lambda_rule(self.json, BundleError) if "lambda_rule" in self.json else CLIENT_RULE

    def new_device_lambda_rule(self) -> tuple[LambdaRule, str | None]:
        """The lambda rule a new device built `--like` this bundle can use, and why the
        bundle's own was set aside (None when it was not). `knnper-edge init` interpolates
        with the encoder's classifier, not a linear head fitted on the device as the seen
        clients' were; a pooled rule measured on those heads ranks lambdas for another mixture
        (on digits it picked lambda 0, the global model alone: 2-8% accuracy), so the device
        then chooses from its own validation split, on the base it will have."""
        rule = self.lambda_rule
        if rule.name == "client" or self.base == "global":
            return rule, None
        return CLIENT_RULE, (
            f"the bundle's {rule.name} lambda evidence was measured with each "
            "client's own linear head as the base, which a new device does not "
            "have; lambda is chosen on its own validation split (the client "
            "rule)"
        )

    def with_datastore(
        self, footprint: Footprint, files: dict[str, str], datastore: Any = None, where: str = ""
    ) -> Manifest:
        """This manifest with the files written (and, after an on-device update, the recipe of
        the `datastore` stored)."""
        new = self.to_json()
        if datastore is not None:
            new["backend"] = _backend_record(datastore)
        new.update(footprint=footprint._asdict(), files=files)
        return Manifest(validate_manifest(to_json_types(new), where or "write_bundle"))

    def departure_from(self, base: Manifest) -> str | None:
        """What this manifest changes of `base` (a signed one) beyond what an on-device update
        may change (DEVICE: the datastore's files and size, its sample counts), else None."""
        ours, theirs = self.json, base.json
        for key in sorted(set(ours) | set(theirs)):
            if key not in self.DEVICE and ours.get(key) != theirs.get(key):
                return repr(key)
        if self.files.get(ENCODER_FILE) != base.files.get(ENCODER_FILE):
            return "the encoder's sha256"
        if self.footprint.encoder != base.footprint.encoder:
            return "the encoder's footprint"
        if self.backend != base.backend or _fixed_params(self.params) != _fixed_params(base.params):
            return "the datastore backend"
        return None


# Recipe parameters an update may change: how many samples are stored (and, for ProtoNN, how
# many the buffer holds); the budget still bounds the files they take.
_COUNT_PARAMS = ("n", "buffer")


def _fixed_params(params: dict) -> dict:
    """The recipe's parameters an update cannot change (all but the sample counts)."""
    return {key: value for key, value in params.items() if key not in _COUNT_PARAMS}


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """Bytes of a manifest -> the schema-checked manifest. BundleError, never RecursionError or
    MemoryError: the size, the nesting and repeated keys are bounded or refused."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise BundleError(f"{where}: over {MAX_MANIFEST_BYTES} bytes, too large for a manifest")
    try:
        manifest = parse_json(raw, max_depth=MAX_MANIFEST_DEPTH)
    except ValueError as exc:  # not UTF-8 or JSON, too deep, repeated keys, NaN, huge integers
        raise BundleError(f"{where}: {exc}") from None
    return Manifest(validate_manifest(manifest, where))


def read_manifest_bytes(bundle_dir: Path) -> bytes:
    where = f"bundle {bundle_dir}"
    if not bundle_dir.is_dir():
        raise BundleError(f"{where}: not a directory")
    return read_within(
        bundle_dir / MANIFEST,
        MAX_MANIFEST_BYTES,
        lambda why: BundleError(f"{where}: {MANIFEST} {why}"),
    )


def read_manifest(bundle_dir: str | os.PathLike) -> Manifest:
    """Parse and schema-check manifest.json only (no file hashes): for `info` and `--like`."""
    bundle_dir = Path(bundle_dir)
    raw = read_manifest_bytes(bundle_dir)
    return parse_manifest(raw, f"bundle {bundle_dir}: {MANIFEST}")


@dataclass(frozen=True)
class BundleFields:
    """What the writer of a bundle decides; `write_bundle` derives the rest from the datastore
    (num_classes, embedding_dim, k, sigma, backend) and from the files it writes (footprint,
    files).

    Parameters
    ----------
    client_id : the client the bundle is personalised for (-1: a device that never trained).
    input : what the encoder takes.
    lam : the interpolation weight of the kNN.
    budget_bytes : the device's budget, encoder included.
    update_strategy : how `add` makes room ("fifo", "concatenate", "fixed"); None: "fifo",
        or "concatenate" for a ProtoNN datastore without a buffer (no fifo capacity).
    knn_choice : where the kNN setting came from, where the writer records it.
    lambda_rule : how lambda was chosen; recorded where it pools evidence (a bundle that
        records none runs the client rule, the paper's).
    model : the model version the bundle is built from, with the one it replaces as its
        lineage; None records none.
    """

    client_id: int
    input: InputSpec
    lam: float
    budget_bytes: int
    update_strategy: str | None = None
    knn_choice: KNNProvenance | None = None
    lambda_rule: LambdaRule = CLIENT_RULE
    model: ModelVersion | None = None

    def records(self) -> dict[str, Any]:
        """The optional records these fields write (knn_choice, lambda_rule, model,
        replaces), in that order."""
        out: dict[str, Any] = {}
        if self.knn_choice is not None:
            out["knn_choice"] = self.knn_choice.to_json()
        if self.lambda_rule.name != CLIENT_RULE.name:
            out["lambda_rule"] = self.lambda_rule.to_dict()
        if self.model is not None:
            out["model"] = self.model.to_record()
            if self.model.replaces is not None:
                out["replaces"] = self.model.replaces.to_record()
        return out


def build_manifest(fields: BundleFields, datastore: Any) -> Manifest:
    """A manifest from the writer's fields and a fitted datastore, its footprint and files
    still to be filled in (`Manifest.with_datastore`) once the files are written."""
    if not hasattr(datastore, "embedding_dim_"):
        raise BundleError("write_bundle: the datastore is not fitted")
    no_capacity = datastore.TRAINED and not datastore.sample_store().n
    default_strategy = "concatenate" if no_capacity else "fifo"
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "client_id": fields.client_id,
        "input": fields.input.to_json(),
        "num_classes": int(datastore.num_classes),
        "embedding_dim": int(datastore.embedding_dim_),
        "k": int(datastore.k),
        "sigma": float(datastore.sigma),
        "lambda": float(fields.lam) if is_real(fields.lam) else fields.lam,
        "backend": _backend_record(datastore),
        "update_strategy": fields.update_strategy or default_strategy,
        "budget_bytes": fields.budget_bytes,
        **fields.records(),
    }
    for key in ("client_id", "budget_bytes"):
        if isinstance(manifest[key], np.integer):
            manifest[key] = int(manifest[key])
    try:
        manifest = to_json_types(manifest)
    except TypeError as exc:
        raise BundleError(f"write_bundle: manifest fields are not JSON data: {exc}") from None
    # checked before anything is written: the files are not known yet, only their layout
    placeholder = dict.fromkeys(
        (ENCODER_FILE, *BACKENDS[manifest["backend"]["name"]].FILES), "0" * 64
    )
    manifest.update(footprint={"encoder": 0, "datastore": 0, "total": 0}, files=placeholder)
    return Manifest(validate_manifest(manifest, "write_bundle"))


def _backend_record(datastore: Any) -> dict[str, Any]:
    return {
        "name": datastore.backend,
        "recipe": datastore.recipe,
        "params": datastore.recipe_params(),
    }
