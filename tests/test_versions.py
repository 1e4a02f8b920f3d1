"""The model version (edge_runtime.versions.ModelVersion): one type and one text form for which
training and which embedding space a bundle, a release or a datastore's keys belong to, the one
place an encoder is hashed, and the order a lineage gives two versions."""

from __future__ import annotations

import ast
import hashlib
import re
from pathlib import Path

import numpy as np
import pytest

from edge_runtime.versions import ModelVersion, describe, stamp
from tests.helpers.bundles import make_image_encoder

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("edge_runtime", "protonn", "fed_train", "export", "experiments", "knnper_cli")
# Modules that hash, and what: none of it an encoder (edge_runtime/versions.py is the place).
HASHERS = {
    "edge_runtime/_io.py": "files by path, streamed (sha256_file)",
    "edge_runtime/signing.py": "the documents a signature covers",
    "edge_runtime/versions.py": "encoders",
    "fed_train/simulation.py": "checkpoints",
    "fed_train/pretrain.py": "a pretraining's record",
    "fed_train/data.py": "downloaded archives",
    "fed_train/run.py": "a run's files",
    "fed_train/knn_choice.py": "torch weights",
    "export/sizing.py": "embeddings (a cache key)",
    "experiments/context.py": "a configuration",
}
_ENCODER_WORDS = re.compile(r"encoder|ENCODER|onnx|personal", re.IGNORECASE)
_HASH_CALLS = {"sha256", "sha1", "md5", "blake2b", "new", "sha256_file", "file_digest"}
_MAY_HASH = re.compile(r"hashlib|sha256|sha1|md5|blake2b|file_digest")


def _sources() -> list[Path]:
    paths = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    return paths + sorted((ROOT / "benchmarks").glob("*.py"))


def encoder_hashing_outside_versions() -> list[str]:
    """Every import of hashlib outside HASHERS, and every hashing call anywhere but
    edge_runtime/versions.py whose argument reads like an encoder (its name or file)."""
    found = []
    for path in _sources():
        where = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        if not _MAY_HASH.search(text):
            continue
        for node in ast.walk(ast.parse(text, where)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if "hashlib" in names and where not in HASHERS:
                found.append(f"{where}:{node.lineno}: imports hashlib")
            if where == "edge_runtime/versions.py" or not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name not in _HASH_CALLS:
                continue
            argument = " ".join(ast.get_source_segment(text, a) or "" for a in node.args)
            if _ENCODER_WORDS.search(argument):
                found.append(f"{where}:{node.lineno}: {name}({argument})")
    return found


def test_an_encoder_is_hashed_only_by_the_model_version():
    assert encoder_hashing_outside_versions() == []


def test_the_hashing_check_finds_an_encoder_hashed_elsewhere(tmp_path, monkeypatch):
    module = tmp_path / "export" / "rogue.py"
    module.parent.mkdir()
    module.write_text(
        "import hashlib\n\n\ndef identity(encoder_path):\n"
        "    return hashlib.sha256(encoder_path.read_bytes()).hexdigest()\n"
    )
    versions = ROOT / "edge_runtime" / "versions.py"
    (tmp_path / "edge_runtime").mkdir()
    (tmp_path / "edge_runtime" / "versions.py").write_text(versions.read_text())
    monkeypatch.setattr(f"{__name__}._sources", lambda: sorted(tmp_path.rglob("*.py")))
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert encoder_hashing_outside_versions() == [
        "export/rogue.py:1: imports hashlib",
        "export/rogue.py:5: sha256(encoder_path.read_bytes())",
    ]


def test_an_unstamped_encoder_is_its_bytes_sha256_and_a_stamped_one_its_stamp(tmp_path):
    import onnx

    path = make_image_encoder(tmp_path / "e.onnx")
    raw = path.read_bytes()
    assert ModelVersion.of_encoder(raw).embedding == hashlib.sha256(raw).hexdigest()
    proto = onnx.load(path)
    stamp(proto)
    stamped = proto.SerializeToString()
    assert ModelVersion.of_encoder(stamped).embedding == hashlib.sha256(raw).hexdigest()
    # a refitted head's bytes with the shipped file's sha256: the file's id
    assert ModelVersion.of_encoder(b"not onnx", "ab" * 32).embedding == "ab" * 32


def _record(run: str, round_: int | None, embedding: str) -> dict:
    return {"run": run, "round": round_, "weights_sha256": None, "embedding": embedding}


def test_a_record_round_trips_in_the_order_the_exporter_writes():
    record = _record("runs/v1", 3, "a" * 64)
    version = ModelVersion.from_record(record)
    assert version.to_record() == record and list(version.to_record()) == list(record)
    assert ModelVersion.from_record(None) is None and describe(None).startswith("unrecorded")


def test_one_text_form():
    assert ModelVersion("c" * 64, "v2", 5).describe() == f"run v2 round 5 (encoder {'c' * 12})"
    assert ModelVersion("c" * 64).describe() == f"encoder {'c' * 12}"


def test_versions_are_ordered_along_a_lineage_only():
    v1 = ModelVersion.from_record(_record("v1", 2, "a" * 64))
    v1_later = ModelVersion.from_record(_record("v1", 4, "b" * 64))
    v2 = ModelVersion.from_record(_record("v2", 2, "c" * 64), _record("v1", 2, "a" * 64))
    other = ModelVersion.from_record(_record("w", 9, "d" * 64))
    assert v1.compare(v1_later) == -1 and v1_later.compare(v1) == 1
    assert v1.older_than(v2) and not v2.older_than(v1) and v2.compare(v1) == 1
    assert v1.compare(v1) == 0
    assert v1.compare(other) is None and not other.older_than(v1) and not v1.older_than(other)
    # another run whose round is lower is not older without a lineage linking them
    assert v1_later.compare(v2) is None


def test_matches_is_the_embedding_space():
    a = ModelVersion.from_record(_record("v1", 2, "a" * 64))
    assert a.matches(ModelVersion("a" * 64)) and not a.matches(ModelVersion("b" * 64))
    assert not a.matches(None)


@pytest.mark.parametrize(
    "array",
    [np.zeros(31, np.uint8), np.zeros(32, np.int8), np.zeros((2, 16), np.uint8)],
)
def test_an_id_array_that_is_not_32_bytes_is_refused(array):
    with pytest.raises(ValueError, match="must be 32 uint8 bytes"):
        ModelVersion.from_array(array, "datastore.npz: embedding_id")
    version = ModelVersion("0f" * 32)
    assert ModelVersion.from_array(version.as_array(), "x") == version


def private_imports() -> list[str]:
    """Every `from <a module of the project> import _name` in the packages: a private function,
    class or constant of another module (a private module such as `_io` is the package's shared
    helpers; a subpackage's modules, edge_runtime/datastores/, share their own)."""
    found = []
    for path in [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]:
        where = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                package = ROOT.joinpath(*where.parts[: len(where.parts) - node.level])
            elif (node.module or "").split(".")[0] in PACKAGES:
                package = ROOT
            else:
                continue
            source = package.joinpath(*(node.module or "").split("."))
            if source.parent == path.parent and len(where.parts) > 2:
                continue  # within one subpackage
            for alias in node.names:
                module = source / alias.name
                if alias.name.startswith("_") and not (
                    module.with_suffix(".py").is_file() or module.is_dir()
                ):
                    found.append(f"{where.as_posix()}:{node.lineno}: {alias.name}")
    return found


def test_no_module_imports_another_modules_private_name():
    """A name one module keeps private is not another's to import (release.py imported
    manifest._validate_model_record; ModelVersion.parse is its public home)."""
    assert private_imports() == []
