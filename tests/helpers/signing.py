"""A signed tiny bundle (tests.helpers.bundles'), for the tests that need cryptography: import it
after `pytest.importorskip("cryptography")`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from edge_runtime.bundle import write_bundle
from edge_runtime.datastores import make_datastore
from edge_runtime.signing import load_private_key
from tests.helpers.bundles import FIELDS, NUM_CLASSES, make_image_encoder, make_images, raw_outputs


def signed_bundle(
    tmp_path: Path, keys: Path, recipe: str = "flat:fp32", budget_bytes: int = FIELDS.budget_bytes
) -> Path:
    enc = make_image_encoder(tmp_path / "encoder.onnx")
    x, y = make_images(60)
    z, _ = raw_outputs(enc, x)
    ds = make_datastore(recipe, NUM_CLASSES, k=5).fit(z, y)
    out = tmp_path / "signed"
    fields = dataclasses.replace(FIELDS, budget_bytes=budget_bytes)
    write_bundle(out, fields, enc, ds, signing_key=load_private_key(keys / "key.pem"))
    return out
