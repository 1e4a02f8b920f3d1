"""Signed bundles: a runtime given a trusted Ed25519 key refuses unsigned bundles and bundles
whose manifest, encoder or signature were changed, and on-device updates keep a signed bundle
verifiable; without a trusted key, unsigned bundles load as before."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("cryptography")

from edge_runtime.bundle import SignatureError  # noqa: E402
from edge_runtime.cli import main as edge_main  # noqa: E402
from edge_runtime.runtime import Runtime  # noqa: E402
from edge_runtime.signing import (  # noqa: E402
    SIGNATURE_FILE,
    generate_key_pair,
    load_public_key,
    verify_file,
)
from tests.helpers.bundles import (  # noqa: E402
    FIELDS,
    build_bundle,
    make_image_encoder,
    make_images,
    rewrite_manifest,
    snapshot,
)
from tests.helpers.signing import signed_bundle  # noqa: E402


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    directory = tmp_path_factory.mktemp("keys")
    generate_key_pair(directory / "key.pem", directory / "key.pub")
    generate_key_pair(directory / "other.pem", directory / "other.pub")
    return directory


def trusted(keys: Path, name: str = "key.pub"):
    return [load_public_key(keys / name)]


def _swap_encoder(bundle: Path) -> None:
    """Another encoder of the same shapes, its sha256 and footprint updated in the manifest."""
    make_image_encoder(bundle / "encoder.onnx", seed=7)
    data = (bundle / "encoder.onnx").read_bytes()
    m = json.loads((bundle / "manifest.json").read_text())
    m["files"]["encoder.onnx"] = hashlib.sha256(data).hexdigest()
    grow = len(data) - m["footprint"]["encoder"]
    m["footprint"]["encoder"] += grow
    m["footprint"]["total"] += grow
    (bundle / "manifest.json").write_text(json.dumps(m, indent=2))


def _forge_base(bundle: Path) -> None:
    """Edit lambda in both the manifest and the signed copy inside signature.json."""
    rewrite_manifest(bundle, **{"lambda": 1.0})
    doc = json.loads((bundle / SIGNATURE_FILE).read_text())
    doc["manifest"] = base64.b64encode((bundle / "manifest.json").read_bytes()).decode()
    (bundle / SIGNATURE_FILE).write_text(json.dumps(doc))


TAMPERED = {
    "edited lambda": (
        lambda b: rewrite_manifest(b, **{"lambda": 1.0}),
        "'lambda' differs from the signed manifest",
    ),
    "edited normalisation": (
        lambda b: rewrite_manifest(b, input={**FIELDS.input.to_json(), "mean": [0.1]}),
        "'input' differs from the signed manifest",
    ),
    "raised budget": (
        lambda b: rewrite_manifest(b, budget_bytes=10**9),
        "'budget_bytes' differs from the signed manifest",
    ),
    "swapped encoder": (_swap_encoder, "the encoder's sha256 differs from the signed manifest"),
    "removed signature": (lambda b: (b / SIGNATURE_FILE).unlink(), "unsigned"),
    "forged signed copy": (_forge_base, "the signature does not verify"),
    "garbage signature": (lambda b: (b / SIGNATURE_FILE).write_text("{"), "malformed"),
}


def test_signed_bundle_verifies_with_the_trusted_key(tmp_path, keys):
    bundle = signed_bundle(tmp_path, keys)
    rt = Runtime.load(bundle, trusted_keys=trusted(keys))
    assert rt.predict(make_images(3)[0]).shape == (3,)


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_tampered_signed_bundle_is_refused(case, tmp_path, keys):
    bundle = signed_bundle(tmp_path, keys)
    tamper, message = TAMPERED[case]
    tamper(bundle)
    before = snapshot(bundle)
    with pytest.raises(SignatureError) as info:
        Runtime.load(bundle, trusted_keys=trusted(keys))
    assert message in str(info.value) and "\n" not in str(info.value)
    assert snapshot(bundle) == before


def test_a_key_that_is_not_trusted_is_refused(tmp_path, keys):
    bundle = signed_bundle(tmp_path, keys)
    with pytest.raises(SignatureError, match="which is not trusted"):
        Runtime.load(bundle, trusted_keys=trusted(keys, "other.pub"))
    Runtime.load(bundle, trusted_keys=trusted(keys, "other.pub") + trusted(keys))


def test_unsigned_bundles_load_when_no_key_is_trusted(tmp_path, keys):
    bundle = build_bundle(tmp_path)
    Runtime.load(bundle)
    with pytest.raises(SignatureError, match="unsigned"):
        Runtime.load(bundle, trusted_keys=trusted(keys))


@pytest.mark.parametrize(
    ("recipe", "strategy"),
    [("flat:int8:n60", "fifo"), ("flat:fp16:n60", "concatenate"), ("hnsw:M8", "fifo")],
)
def test_device_updates_keep_a_signed_bundle_verifiable(tmp_path, keys, recipe, strategy):
    pytest.importorskip("hnswlib")
    bundle = signed_bundle(tmp_path, keys, recipe, budget_bytes=10**7)
    rt = Runtime.load(bundle, trusted_keys=trusted(keys))
    for seed in (1, 2):
        rt.add(*make_images(10, seed), strategy=strategy)
    again = Runtime.load(bundle, trusted_keys=trusted(keys))
    assert len(again.datastore) == (80 if strategy == "concatenate" else 60)
    assert (
        again.manifest.files
        != json.loads(
            base64.b64decode(json.loads((bundle / SIGNATURE_FILE).read_text())["manifest"])
        )["files"]
    )


def test_cli_keygen_and_trusted_key(tmp_path, keys, capsys):
    assert (
        edge_main(
            ["keygen", "--private", str(tmp_path / "k.pem"), "--public", str(tmp_path / "k.pub")]
        )
        == 0
    )
    assert (tmp_path / "k.pem").stat().st_mode & 0o077 == 0
    assert (
        edge_main(
            ["keygen", "--private", str(tmp_path / "k.pem"), "--public", str(tmp_path / "x.pub")]
        )
        == 2
    )
    bundle = signed_bundle(tmp_path, keys)
    capsys.readouterr()
    assert edge_main(["--trusted-key", str(keys / "key.pub"), "info", str(bundle)]) == 0
    assert edge_main(["--trusted-key", str(tmp_path / "k.pub"), "info", str(bundle)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not trusted" in err
    assert edge_main(["--trusted-key", str(tmp_path / "missing.pub"), "info", str(bundle)]) == 2
    assert "cannot read key" in capsys.readouterr().err


def test_export_signs_every_bundle(tmp_path, keys, capsys):
    import knnper_cli.main as export_cli
    from fed_train.algorithms.base import TrainingConfig
    from fed_train.run import RunConfig, train

    run_dir = tmp_path / "run"
    train(
        RunConfig(
            dataset="digits",
            clients=4,
            seed=0,
            training=TrainingConfig(rounds=1, epochs=1, batch_size=16),
        ),
        run_dir,
        progress=False,
    )
    out = tmp_path / "bundles"
    code = export_cli.main(
        [
            "--no-progress",
            "export",
            str(run_dir),
            "--out",
            str(out),
            "--budget",
            "2M",
            "--backend",
            "flat",
            "--clients",
            "0,1",
            "--signing-key",
            str(keys / "key.pem"),
            "--workers",
            "1",
        ]
    )
    assert code == 0, capsys.readouterr().err
    for bundle in sorted(out.glob("client_*")):
        rt = Runtime.load(bundle, trusted_keys=trusted(keys))
        assert rt.predict(np.zeros((1, 8, 8, 1), np.uint8)).shape == (1,)
    # the shared encoder a new device builds on is signed too
    verify_file(out / "encoder.onnx", (out / "encoder.onnx").read_bytes(), trusted(keys))
    code = export_cli.main(
        [
            "--no-progress",
            "export",
            str(run_dir),
            "--out",
            str(tmp_path / "b2"),
            "--budget",
            "2M",
            "--signing-key",
            str(keys / "key.pub"),
        ]
    )
    assert code == 2 and "not an unencrypted PEM private key" in capsys.readouterr().err


def test_init_like_verifies_the_signed_bundle_and_the_encoder(tmp_path, keys, capsys):
    """init --like took k and the input normalisation from an edited signed manifest, and
    any --encoder, without verifying either."""
    bundle = signed_bundle(tmp_path, keys)
    x, y = make_images(40)
    np.savez(tmp_path / "own.npz", x=x, y=y)
    other = make_image_encoder(tmp_path / "other.onnx", seed=7)

    def init(encoder: Path, out: str, *extra: str) -> tuple[int, str]:
        capsys.readouterr()
        code = edge_main(
            [
                *extra,
                "init",
                "--encoder",
                str(encoder),
                "--data",
                str(tmp_path / "own.npz"),
                "--budget",
                "1MB",
                "--out",
                str(tmp_path / out),
                "--like",
                str(bundle),
            ]
        )
        return code, capsys.readouterr().err

    key = ["--trusted-key", str(keys / "key.pub")]
    assert init(bundle / "encoder.onnx", "good", *key)[0] == 0
    code, err = init(other, "swapped", *key)
    assert code == 2 and err.count("\n") == 1 and "is not the encoder the signed bundle" in err
    rewrite_manifest(bundle, k=3)
    code, err = init(bundle / "encoder.onnx", "edited", *key)
    assert code == 2 and err.count("\n") == 1 and "'k' differs from the signed manifest" in err
    assert not (tmp_path / "swapped").exists() and not (tmp_path / "edited").exists()
    code, err = init(bundle / "encoder.onnx", "other-key", "--trusted-key", str(keys / "other.pub"))
    assert code == 2 and "not trusted" in err
    assert init(bundle / "encoder.onnx", "unchecked")[0] == 0  # no key: not checked, as before
    (tmp_path / "spec.json").write_text(json.dumps(FIELDS.input.to_json()))
    assert (
        edge_main(
            [
                *key,
                "init",
                "--encoder",
                str(bundle / "encoder.onnx"),
                "--data",
                str(tmp_path / "own.npz"),
                "--budget",
                "1MB",
                "--out",
                str(tmp_path / "spec"),
                "--input-spec",
                str(tmp_path / "spec.json"),
            ]
        )
        == 2
    )
    assert "needs --like SIGNED_BUNDLE" in capsys.readouterr().err


def _linear_base_release(root: Path, keys: Path) -> Path:
    """An export's layout with the linear base: a shared encoder (stamped with its embedding
    id, signed beside it as `knnper export --signing-key` does) and client 3's signed bundle
    carrying its own encoder, the shared one with a linear head of its own."""
    from edge_runtime.bundle import write_bundle
    from edge_runtime.datastores import make_datastore
    from edge_runtime.encoder import optimize_encoder
    from edge_runtime.linear_head import LinearHead
    from edge_runtime.signing import load_private_key, sign_file
    from edge_runtime.versions import ModelVersion
    from export.personal_encoder import with_linear_head
    from tests.helpers.bundles import NUM_CLASSES, raw_outputs

    release = root / "release"
    release.mkdir()
    shared = release / "encoder.onnx"
    shared.write_bytes(optimize_encoder(make_image_encoder(root / "raw.onnx").read_bytes()))
    x, y = make_images(60)
    z, _ = raw_outputs(shared, x)
    personal = with_linear_head(shared, LinearHead(NUM_CLASSES, l2=1e-2).fit(z, y))
    assert (
        ModelVersion.of_encoder(personal).embedding
        == ModelVersion.of_encoder(shared.read_bytes()).embedding
        != ModelVersion.of_encoder(b"").embedding
    )
    model = {"run": "v1", "round": 2, "weights_sha256": "0" * 64}
    model["embedding"] = ModelVersion.of_encoder(shared.read_bytes()).embedding
    private = load_private_key(keys / "key.pem")
    ds = make_datastore("flat:fp32", NUM_CLASSES, k=5).fit(z, y)
    write_bundle(
        release / "client_0003",
        dataclasses.replace(FIELDS, model=ModelVersion.from_record(model)),
        personal,
        ds,
        signing_key=private,
    )
    sign_file(shared, private)
    return release


def test_init_like_takes_the_exports_signed_shared_encoder(tmp_path, keys, capsys):
    """With the linear base a client's bundle carries its own encoder, and init --like refused
    the export's shared one that a device builds on, though it is signed (as a Flower node
    takes it); an unsigned, altered, untrusted or other release's encoder is still refused."""
    from edge_runtime.encoder import optimize_encoder
    from edge_runtime.signing import load_private_key, sign_file

    release = _linear_base_release(tmp_path, keys)
    shared = release / "encoder.onnx"
    x, y = make_images(40)
    np.savez(tmp_path / "own.npz", x=x, y=y)

    def init(encoder: Path, out: str) -> tuple[int, str]:
        capsys.readouterr()
        argv = ["--trusted-key", str(keys / "key.pub"), "init", "--encoder", str(encoder)]
        argv += ["--data", str(tmp_path / "own.npz"), "--budget", "1MB", "--out"]
        code = edge_main([*argv, str(tmp_path / out), "--like", str(release / "client_0003")])
        return code, capsys.readouterr().err

    def variant(name: str, data: bytes, signer: str | None) -> Path:
        path = tmp_path / name / "encoder.onnx"
        path.parent.mkdir()
        path.write_bytes(data)
        if signer is not None:
            sign_file(path, load_private_key(keys / signer))
        return path

    assert init(shared, "device") == (0, "")
    built = Runtime.load(tmp_path / "device")
    assert (tmp_path / "device" / "encoder.onnx").read_bytes() == shared.read_bytes()
    assert (
        built.manifest.model.to_record()
        == json.loads((release / "client_0003" / "manifest.json").read_text())["model"]
    )
    altered = variant("altered", shared.read_bytes() + b"\0", None)
    (altered.parent / "encoder.onnx.sig.json").write_bytes(
        (release / "encoder.onnx.sig.json").read_bytes()
    )
    other_version = optimize_encoder(
        make_image_encoder(tmp_path / "raw2.onnx", seed=1).read_bytes()
    )
    for path, message in (
        (
            variant("unsigned", shared.read_bytes(), None),
            "unsigned (encoder.onnx.sig.json is missing)",
        ),
        (altered, "the file is not the one that was signed"),
        (variant("untrusted", shared.read_bytes(), "other.pem"), "which is not trusted"),
        (variant("v2", other_version, "key.pem"), "(signed) is encoder"),
    ):
        code, err = init(path, f"device-{path.parent.name}")
        assert code == 2 and err.count("\n") == 1 and message in err, err
        assert not (tmp_path / f"device-{path.parent.name}").exists()


@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_a_signature_that_is_a_pipe_or_a_link_is_not_called_missing(tmp_path, keys, kind):
    import os

    bundle = signed_bundle(tmp_path, keys)
    (bundle / SIGNATURE_FILE).rename(tmp_path / "real.json")
    if kind == "fifo":
        os.mkfifo(bundle / SIGNATURE_FILE)
    else:
        (bundle / SIGNATURE_FILE).symlink_to(tmp_path / "real.json")
    with pytest.raises(SignatureError, match="is a link or not a regular file"):
        Runtime.load(bundle, trusted_keys=trusted(keys))


_DAMAGES = {
    "missing": lambda doc: doc.unlink(),
    "link": lambda doc: (doc.rename(doc.with_name("real")), doc.symlink_to(doc.with_name("real"))),
    "malformed": lambda doc: doc.write_text("{}"),
    "algorithm": lambda doc: _edit_document(doc, algorithm="rsa"),
    "untrusted": lambda doc: _edit_document(doc, key="0" * 64),
    "forged": lambda doc: _edit_document(doc, signature=base64.b64encode(b"x" * 64).decode()),
}


def _edit_document(doc: Path, **fields) -> None:
    doc.write_text(json.dumps({**json.loads(doc.read_text()), **fields}))


@pytest.mark.parametrize("damage", sorted(_DAMAGES))
def test_a_bundles_signature_and_a_files_fail_alike(tmp_path, keys, damage):
    """One reader: a file's signature (a key map's, an encoder's) that was a link was called
    missing, and its algorithm was never read."""
    from edge_runtime.signing import load_private_key, sign_file, verify_signature

    bundle = signed_bundle(tmp_path, keys)
    (tmp_path / "f").mkdir()
    shared = tmp_path / "f" / "payload"
    shared.write_bytes(b"a release file")
    sign_file(shared, load_private_key(keys / "key.pem"))
    _DAMAGES[damage](bundle / SIGNATURE_FILE)
    _DAMAGES[damage](tmp_path / "f" / "payload.sig.json")
    errors = []
    with pytest.raises(SignatureError) as err:
        verify_signature(
            bundle, json.loads((bundle / "manifest.json").read_text()), trusted(keys), "B"
        )
    errors.append(str(err.value).replace(SIGNATURE_FILE, "DOC"))
    with pytest.raises(SignatureError) as err:
        verify_file(shared, shared.read_bytes(), trusted(keys))
    errors.append(str(err.value).replace(f"{shared}:", "B:").replace("payload.sig.json", "DOC"))
    assert errors[0] == errors[1] and "\n" not in errors[0], errors
