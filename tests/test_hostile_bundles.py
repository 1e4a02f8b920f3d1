"""Hostile bundles: files rewritten by someone who also rewrote the manifest's sha256 list (so
every hash matches) must still end in one BundleError line, never a crash, a RecursionError or
a MemoryError, and loading them writes nothing."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest

import edge_runtime.bundle as bundle_module
from edge_runtime.bundle import BundleError
from edge_runtime.cli import main
from edge_runtime.manifest import MAX_MANIFEST_BYTES
from edge_runtime.runtime import Runtime
from tests.helpers.bundles import REPO, build_bundle, make_images, snapshot

pytest.importorskip("hnswlib")


def rehash(bundle: Path) -> None:
    """What an attacker who controls the manifest does: list every file's real sha256 and size."""
    m = json.loads((bundle / "manifest.json").read_text())
    sizes = {}
    for name in m["files"]:
        data = (bundle / name).read_bytes()
        m["files"][name] = hashlib.sha256(data).hexdigest()
        sizes[name] = len(data)
    encoder = sizes["encoder.onnx"]
    datastore = sum(size for name, size in sizes.items() if name != "encoder.onnx")
    m["footprint"] = {"encoder": encoder, "datastore": datastore, "total": encoder + datastore}
    m["budget_bytes"] = max(m["budget_bytes"], encoder + datastore)
    (bundle / "manifest.json").write_text(json.dumps(m))


def assert_refused(bundle: Path, fragment: str) -> None:
    before, around = snapshot(bundle), sorted(os.listdir(bundle.parent))
    with pytest.raises(BundleError) as info:
        Runtime.load(bundle)
    message = str(info.value)
    assert fragment in message and "\n" not in message, message
    assert snapshot(bundle) == before and sorted(os.listdir(bundle.parent)) == around


# ----------------------------------------------------------------------------- hnsw.bin

# Byte offsets in hnswlib's saveIndex header, and where level-0 records start.
_MAX_ELEMENTS, _ENTRY_POINT, _LEVEL0 = 8, 52, 96


def _patch(offset: int, fmt: str, value) -> callable:
    def edit(data: bytearray) -> bytearray:
        struct.pack_into(fmt, data, offset, value)
        return data

    return edit


def _link_to(element: int):
    """Element 0's first level-0 neighbour becomes `element`."""

    def edit(data: bytearray) -> bytearray:
        struct.pack_into("<HHI", data, _LEVEL0, 1, 0, element)
        return data

    return edit


HOSTILE_INDEXES = {
    "entry point out of range": (_patch(_ENTRY_POINT, "<I", 10**6), "entry point 1000000"),
    "neighbour out of range": (_link_to(10**6), "a level-0 link names an element"),
    "too many links": (_patch(_LEVEL0, "<H", 0xFFFF), "more than 32 links on level 0"),
    "reserved memory": (_patch(_MAX_ELEMENTS, "<Q", 10**12), "reserves room for"),
    "deleted mark": (_patch(_LEVEL0 + 2, "<B", 1), "marked deleted"),
    "wrong dimension": (_patch(24, "<Q", 10), "record layout"),
    "truncated": (lambda data: data[:-7], "cut short"),
    "trailing bytes": (lambda data: data + b"\0" * 8, "bytes follow the last link list"),
    "nan vector": (_patch(_LEVEL0 + 4 + 32 * 4, "<f", float("nan")), "NaN"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_INDEXES))
def test_crafted_hnsw_index_is_refused_before_hnswlib_reads_it(case, tmp_path):
    bundle = build_bundle(tmp_path, "hnsw:M16")
    edit, fragment = HOSTILE_INDEXES[case]
    path = bundle / "hnsw.bin"
    path.write_bytes(bytes(edit(bytearray(path.read_bytes()))))
    rehash(bundle)
    assert_refused(bundle, fragment)


def test_crafted_hnsw_index_gives_one_line_from_the_cli_not_a_crash(tmp_path):
    bundle = build_bundle(tmp_path, "hnsw:M16")
    path = bundle / "hnsw.bin"
    path.write_bytes(bytes(_link_to(10**6)(bytearray(path.read_bytes()))))
    rehash(bundle)
    np.save(tmp_path / "x.npy", make_images(4)[0])
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge_runtime.cli",
            "predict",
            str(bundle),
            "--input",
            str(tmp_path / "x.npy"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 2, out  # a SIGSEGV would be -11
    assert out.stderr.count("\n") == 1 and "not a valid hnswlib index" in out.stderr


# ----------------------------------------------------------------------------- encoder.onnx


def test_encoder_with_external_data_is_refused(tmp_path):
    bundle = build_bundle(tmp_path)
    model = onnx.load(bundle / "encoder.onnx")
    onnx.save(
        model,
        bundle / "encoder.onnx",
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="weights.bin",
        size_threshold=0,
    )
    rehash(bundle)
    assert_refused(bundle, "keeps tensors in external data files")


def test_encoder_runs_from_the_bytes_that_were_hashed(bundle, monkeypatch):
    """Whichever session holds it: the encoder's own, or the one-session predictor's."""
    given = []
    encoder, predictor = bundle_module.Encoder, bundle_module.Predictor
    monkeypatch.setattr(
        bundle_module, "Encoder", lambda model, **kw: given.append(model) or encoder(model, **kw)
    )
    monkeypatch.setattr(
        bundle_module,
        "Predictor",
        lambda m, ds, model, **kw: given.append(model) or predictor(m, ds, model, **kw),
    )
    Runtime.load(bundle)
    assert given == [(bundle / "encoder.onnx").read_bytes()]


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    return build_bundle(tmp_path)


# ----------------------------------------------------------------------------- datastore.npz


def _npz_bytes(members: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression) as zf:
        for name, data in members.items():
            zf.writestr(name, data, compress_type=compression)
    return buf.getvalue()


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _datastore_members(bundle: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(bundle / "datastore.npz") as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def test_compressed_npz_bomb_is_refused_before_inflating(tmp_path):
    bundle = build_bundle(tmp_path)
    members = _datastore_members(bundle)
    members["keys.npy"] = _npy(np.zeros((2_000_000, 6), np.float32))  # 48 MB inflated
    data = _npz_bytes(members, zipfile.ZIP_DEFLATED)
    assert len(data) < 200_000
    (bundle / "datastore.npz").write_bytes(data)
    rehash(bundle)
    assert_refused(bundle, "member 'keys.npy' is compressed")


def test_npy_header_declaring_more_than_its_data_is_refused(tmp_path):
    bundle = build_bundle(tmp_path)
    members = _datastore_members(bundle)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (10**12, 6)}
    )
    members["keys.npy"] = header.getvalue() + b"\0" * 64
    (bundle / "datastore.npz").write_bytes(_npz_bytes(members))
    rehash(bundle)
    assert_refused(bundle, "declares a float32 array of shape [1000000000000, 6]")


def test_npz_holding_python_objects_is_refused(tmp_path):
    bundle = build_bundle(tmp_path)
    members = _datastore_members(bundle)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "|O", "fortran_order": False, "shape": (1,)}
    )
    members["labels.npy"] = header.getvalue() + b"\x80\x04N."
    (bundle / "datastore.npz").write_bytes(_npz_bytes(members))
    rehash(bundle)
    assert_refused(bundle, "holds Python objects")


# ----------------------------------------------------------------------------- manifest.json


def _manifest_text(bundle: Path) -> str:
    return (bundle / "manifest.json").read_text()


def _huge(bundle: Path) -> None:
    m = json.loads(_manifest_text(bundle))
    m["padding"] = "x" * MAX_MANIFEST_BYTES
    (bundle / "manifest.json").write_text(json.dumps(m))


def _deep_brackets(bundle: Path) -> None:
    (bundle / "manifest.json").write_text("[" * 30_000 + "]" * 30_000)


def _nested_field(bundle: Path) -> None:
    m = json.loads(_manifest_text(bundle))
    value: object = 0.5
    for _ in range(20):
        value = [value]
    m["input"]["mean"] = value
    (bundle / "manifest.json").write_text(json.dumps(m))


def _duplicate_key(bundle: Path) -> None:
    text = _manifest_text(bundle)
    (bundle / "manifest.json").write_text(text.replace('"lambda":', '"lambda": 1.0, "lambda":', 1))


def _nan(bundle: Path) -> None:
    m = json.loads(_manifest_text(bundle))
    m["sigma"] = float("nan")
    (bundle / "manifest.json").write_text(json.dumps(m))


def _long_integer(bundle: Path) -> None:
    text = _manifest_text(bundle)
    m = json.loads(text)
    (bundle / "manifest.json").write_text(text.replace(f'"k": {m["k"]}', '"k": ' + "9" * 5000, 1))


def _set_field(name: str, value):
    def edit(bundle: Path) -> None:
        m = json.loads(_manifest_text(bundle))
        m[name] = value
        (bundle / "manifest.json").write_text(json.dumps(m))

    return edit


HOSTILE_MANIFESTS = {
    "k of 2^63": (_set_field("k", 2**63), "k must be an integer from 1 to"),
    "subnormal sigma": (_set_field("sigma", 1e-320), "sigma must be a number from 1e-30"),
    "over 64 KiB": (_huge, "manifest.json is over 65536 bytes"),
    "30000 nested brackets": (_deep_brackets, "nested deeper than 8 levels"),
    "20-deep field": (_nested_field, "nested deeper than 8 levels"),
    "duplicate key": (_duplicate_key, "duplicate key(s) ['lambda']"),
    "NaN": (_nan, "NaN is not a JSON number"),
    "5000-digit integer": (_long_integer, "integer string conversion"),
    "not UTF-8": (lambda b: (b / "manifest.json").write_bytes(b"\xff\xfe{}"), "not UTF-8"),
    "lambda rule not an object": (_set_field("lambda_rule", [1]), "'lambda_rule' must be an"),
    "lambda rule of 1000 grid values": (
        _set_field(
            "lambda_rule",
            {"name": "pooled", "pooled": [], "prior_samples": 0, "grid": [0.5] * 1000},
        ),
        "a grid of 1 to 64 numbers",
    ),
    "lambda rule without evidence": (
        _set_field(
            "lambda_rule", {"name": "pooled", "pooled": [], "prior_samples": 0, "grid": [0.0, 1.0]}
        ),
        "needs pooled evidence",
    ),
    "lambda rule with negative counts": (
        _set_field(
            "lambda_rule",
            {
                "name": "shrunk",
                "pooled": [[-1, 2, 3], [1, 2, 3]],
                "prior_samples": 1,
                "grid": [0.0, 1.0],
            },
        ),
        "needs pooled evidence",
    ),
    "lambda rule named otherwise": (
        _set_field(
            "lambda_rule", {"name": "oracle", "pooled": [], "prior_samples": 0, "grid": [0.5]}
        ),
        "lambda rule must be one of",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_MANIFESTS))
def test_hostile_manifest_is_one_bundle_error(case, tmp_path, capsys):
    bundle = build_bundle(tmp_path)
    edit, fragment = HOSTILE_MANIFESTS[case]
    edit(bundle)
    assert_refused(bundle, fragment)
    code = main(["info", str(bundle)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and fragment in err, err


# ----------------------------------------------------------------------------- leftovers


def test_stale_generation_left_by_a_killed_update_is_removed_at_load(bundle):
    stale = {
        "datastore.7.npz": b"\0" * 500_000,  # past the budget next to the live generation
        "datastore.8.npz.tmp-4242-0123abcd": b"half",
        "manifest.json.tmp-4242-89abcdef": b"{",
    }
    for name, data in stale.items():
        (bundle / name).write_bytes(data)
    (bundle / "notes.txt").write_text("mine")
    Runtime.load(bundle).predict(make_images(2)[0])
    assert sorted(p.name for p in bundle.iterdir()) == [
        "datastore.npz",
        "encoder.onnx",
        "manifest.json",
        "notes.txt",
    ]


# ----------------------------------------------------------------------------- datastore values


def _protonn_bundle(tmp_path: Path) -> Path:
    from edge_runtime.bundle import write_bundle
    from edge_runtime.datastores.protonn import ProtoNNDatastore
    from tests.helpers.bundles import FIELDS, NUM_CLASSES, P, make_image_encoder

    enc = make_image_encoder(tmp_path / "encoder.onnx")
    rng = np.random.default_rng(0)
    ds = ProtoNNDatastore.from_matrices(
        rng.normal(size=(3, P)), rng.normal(size=(3, 5)), rng.random((NUM_CLASSES, 5)), 0.5
    )
    write_bundle(tmp_path / "b", dataclasses.replace(FIELDS, budget_bytes=10**6), enc, ds)
    return tmp_path / "b"


def _rewrite_member(bundle: Path, name: str, value: np.ndarray) -> None:
    """Replace one array of datastore.npz (stored, as bundles keep them) and re-list hashes."""
    with np.load(bundle / "datastore.npz") as f:
        arrays = dict(f)
    arrays[name] = value
    np.savez(bundle / "datastore.npz", **arrays)
    rehash(bundle)


@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("protonn Z 1e300", "datastore.npz: Z holds NaN or values past float32's range"),
        ("protonn Z sums past float32", "datastore.npz: Z's class scores can reach"),
        ("protonn gamma 1e300", "datastore.npz: gamma must be one positive number whose square"),
        ("int8 scale 1e-45", "datastore.npz: scale must be"),
        ("int8 scale 1e300", "datastore.npz: scale must be"),
    ],
)
def test_crafted_datastore_values_are_refused_naming_bundle_and_field(case, fragment, tmp_path):
    if case.startswith("protonn"):
        bundle = _protonn_bundle(tmp_path)
        with np.load(bundle / "datastore.npz") as f:
            z = f["Z"].astype(np.float64)
        value = {
            "protonn Z 1e300": np.full_like(z, 1e300),
            "protonn Z sums past float32": np.full_like(z, 3e38).astype(np.float32),
            "protonn gamma 1e300": np.float64(1e300),
        }[case]
        _rewrite_member(bundle, "gamma" if "gamma" in case else "Z", value)
    else:
        bundle = build_bundle(tmp_path, "flat:int8")
        with np.load(bundle / "datastore.npz") as f:
            scale = f["scale"].astype(np.float64)
        _rewrite_member(bundle, "scale", np.full_like(scale, float(case.split()[-1])))
    assert_refused(bundle, fragment)
    # a separate process, warnings on: numpy's RuntimeWarnings must not print before the line
    done = subprocess.run(
        [
            sys.executable,
            "-W",
            "default",
            "-c",
            "import sys; from edge_runtime.cli import main; sys.exit(main(sys.argv[1:]))",
            "predict",
            str(bundle),
            "--input",
            str(_images_file(tmp_path)),
        ],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert fragment in done.stderr and str(bundle) in done.stderr, done.stderr


def _images_file(tmp_path: Path) -> Path:
    path = tmp_path / "x.npy"
    np.save(path, make_images(2)[0])
    return path
