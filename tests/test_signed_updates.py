"""Every update the runtime allows keeps a bundle loadable, signed or not, on every backend and
strategy: the signature lets the datastore's files and sample counts change within the signed
budget, and nothing else (the recipe string included)."""

from __future__ import annotations

import base64
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("cryptography")

from edge_runtime.bundle import BundleError, SignatureError, write_bundle  # noqa: E402
from edge_runtime.cli import main as edge_main  # noqa: E402
from edge_runtime.datastores import BACKENDS, ProtoNNDatastore, make_datastore  # noqa: E402
from edge_runtime.runtime import Runtime  # noqa: E402
from edge_runtime.signing import (  # noqa: E402
    SIGNATURE_FILE,
    generate_key_pair,
    load_private_key,
    load_public_key,
)
from tests.helpers.bundles import (  # noqa: E402
    FIELDS,
    NUM_CLASSES,
    P,
    make_image_encoder,
    make_images,
    raw_outputs,
)

STRATEGIES = ("fifo", "concatenate", "fixed")


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("keys")
    generate_key_pair(directory / "key.pem", directory / "key.pub")
    return directory


def _datastore(backend: str, enc: Path):
    if backend == "protonn":
        rng = np.random.default_rng(0)
        return ProtoNNDatastore.from_matrices(
            rng.normal(size=(3, P)),
            rng.normal(size=(3, 5)),
            rng.random((NUM_CLASSES, 5)),
            0.5,
            k=5,
            m=0.3,
            buffer=8,
        )
    x, y = make_images(30)
    z, _ = raw_outputs(enc, x)
    recipe = {"flat": "flat:int8:n30", "hnsw": "hnsw:M8"}[backend]
    return make_datastore(recipe, NUM_CLASSES, k=5).fit(z, y)


def _bundle(tmp_path: Path, backend: str, strategy: str, signing_key=None) -> Path:
    if backend == "hnsw":
        pytest.importorskip("hnswlib")
    enc = make_image_encoder(tmp_path / "encoder.onnx")
    fields = dataclasses.replace(FIELDS, budget_bytes=10**6, update_strategy=strategy)
    write_bundle(tmp_path / "b", fields, enc, _datastore(backend, enc), signing_key=signing_key)
    return tmp_path / "b"


def _trust(keys: Path, signed: bool) -> list[str]:
    return ["--trusted-key", str(keys / "key.pub")] if signed else []


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_allowed_update_keeps_the_bundle_verifiable(
    tmp_path, keys, backend, strategy, signed, capsys
):
    key = load_private_key(keys / "key.pem") if signed else None
    trusted = [load_public_key(keys / "key.pub")] if signed else None
    bundle = _bundle(tmp_path, backend, strategy, key)
    rt = Runtime.load(bundle, trusted_keys=trusted)
    before = len(rt.datastore.sample_store())
    rt.add(*make_images(12, 1))  # the bundle's own strategy, as a plain `add` does
    x, y = make_images(12, 2)
    np.savez(tmp_path / "val.npz", x=x, y=y)
    args = [
        *_trust(keys, signed),
        "add",
        str(bundle),
        "--data",
        str(tmp_path / "val.npz"),
        "--strategy",
        strategy,
    ]
    assert edge_main(args) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert edge_main([*_trust(keys, signed), "info", str(bundle)]) == 0, capsys.readouterr().err
    again = Runtime.load(bundle, trusted_keys=trusted)
    after = len(again.datastore.sample_store())
    expected = {
        "fixed": before,
        "fifo": max(before, min(24, again.capacity)),
        "concatenate": before + 24,
    }[strategy]
    assert after == expected
    if backend == "protonn" and strategy == "concatenate":  # the buffer grew past b8
        assert again.manifest.recipe == f"protonn:d3:m0.3:b{after}"


def test_a_forged_recipe_string_is_refused_signed_or_not(tmp_path, keys):
    bundle = _bundle(tmp_path, "flat", "fifo", load_private_key(keys / "key.pem"))
    m = json.loads((bundle / "manifest.json").read_text())
    m["backend"]["recipe"] = "flat:fp32:n30"  # the params still say int8
    (bundle / "manifest.json").write_text(json.dumps(m))
    for trusted in (None, [load_public_key(keys / "key.pub")]):
        with pytest.raises(BundleError, match="does not match its params"):
            Runtime.load(bundle, trusted_keys=trusted)


def test_a_signed_setting_changed_with_the_counts_is_still_refused(tmp_path, keys):
    """Counts may change; a ProtoNN projection size may not, even beside a count change."""
    bundle = _bundle(tmp_path, "protonn", "concatenate", load_private_key(keys / "key.pem"))
    m = json.loads((bundle / "manifest.json").read_text())
    m["backend"]["params"].update(buffer=20, m=0.5)
    m["backend"]["recipe"] = "protonn:d3:m0.5:b20"
    (bundle / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SignatureError, match="datastore backend differs"):
        Runtime.load(bundle, trusted_keys=[load_public_key(keys / "key.pub")])
    signed = json.loads(
        base64.b64decode(json.loads((bundle / SIGNATURE_FILE).read_text())["manifest"])
    )
    assert signed["backend"]["recipe"] == "protonn:d3:m0.3:b8"
