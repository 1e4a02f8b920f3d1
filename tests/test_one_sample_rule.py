"""One rule for how many samples fit a budget (`head_file.samples_within`) serves the exporter's
sizer and `knnper-edge init` as it serves `add` and `upgrade`: where not even one sample fits,
both refuse in one line (what the encoder and the head take, the budget, the smallest budget
that would fit) instead of writing a bundle that `add` would find over its budget."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edge_runtime import cli as edge_cli
from edge_runtime.budget import Budget
from edge_runtime.datastores import DEVICE_RECIPES, make_datastore
from edge_runtime.head_file import head_nbytes, no_sample_fits, one_sample_room, samples_within
from edge_runtime.personal_head import ClientSplits
from edge_runtime.runtime import Runtime
from export.errors import BudgetInvalid
from export.sizing import DatastoreSizer, SearchSpace
from fed_train.knn_setting import KNNChoice
from tests.helpers.bundles import IMAGE_SPEC, NUM_CLASSES, P, make_image_encoder, make_images

DIM, CLASSES = 16, 3


def test_one_sample_room_is_where_the_rule_first_allows_one_sample():
    stores = [make_datastore(r, CLASSES) for r in ("flat:fp32", "flat:int8", "hnsw:M8")]
    one = min(s.estimate_nbytes(1, DIM) for s in stores)
    head = head_nbytes(DIM, CLASSES)
    assert one_sample_room(stores, DIM, None) == one
    assert one_sample_room(stores, DIM, CLASSES) == head + one
    for head_classes in (None, CLASSES):
        room = one_sample_room(stores, DIM, head_classes)
        for total, most in ((room, 1), (room - 1, 0)):
            budget = Budget(1000 + total, 1000).with_head(head_nbytes(DIM, head_classes))
            assert max(samples_within(s, DIM, budget) for s in stores) == most


def test_the_refusal_says_what_the_encoder_and_the_head_take_and_the_smallest_budget():
    store = make_datastore("flat:fp32", CLASSES)
    one, head = store.estimate_nbytes(1, DIM), head_nbytes(DIM, CLASSES)
    budget = Budget(1000 + head + one - 1, encoder=1000, head=head)
    assert no_sample_fits(budget, [store], DIM) == (
        f"budget {1000 + head + one - 1} bytes: the encoder takes 1000 bytes and the refitted "
        f"linear head's file {head} bytes, leaving {one - 1} bytes, too few for one stored "
        f"sample; the smallest budget that holds one is {1000 + head + one} bytes"
    )
    assert no_sample_fits(Budget(1000 + one - 1, encoder=1000), [store], DIM) == (
        f"budget {1000 + one - 1} bytes: the encoder takes 1000 bytes, leaving {one - 1} bytes, "
        f"too few for one stored sample; the smallest budget that holds one is {1000 + one} bytes"
    )


def _client(seed: int = 0) -> ClientSplits:
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=3.0, size=(CLASSES, DIM))
    y_train, y_val = rng.integers(0, CLASSES, 60), rng.integers(0, CLASSES, 20)
    z_train = (centres[y_train] + rng.normal(size=(60, DIM))).astype(np.float32)
    z_val = (centres[y_val] + rng.normal(size=(20, DIM))).astype(np.float32)
    logits = rng.normal(size=(80, CLASSES)).astype(np.float32)
    return ClientSplits.from_logits(
        0, False, (z_train, logits[:60], y_train), (z_val, logits[60:], y_val)
    )


@pytest.mark.parametrize("base", ["global", "linear"])
def test_the_sizer_stores_what_the_rule_allows_and_refuses_below_one_sample(base):
    space = SearchSpace(backends=("flat",), flat_dtypes=("fp32", "int8"))
    knn = KNNChoice(base=base, l2=0.1 if base == "linear" else None)
    head_classes = CLASSES if base == "linear" else None
    stores = [make_datastore(r, CLASSES) for r in ("flat:fp32", "flat:int8")]
    room = one_sample_room(stores, DIM, head_classes)
    sizer = DatastoreSizer(CLASSES, knn=knn, space=space).fit(_client(), Budget(room, encoder=0))
    assert sizer.best_.stored == 1 == len(sizer.datastore_)
    # the old fallback: one sample measured on its files (about half the estimate) still fit
    with pytest.raises(BudgetInvalid) as err:
        DatastoreSizer(CLASSES, knn=knn, space=space).fit(_client(), Budget(room - 1, encoder=0))
    assert str(err.value) == "client 0: " + no_sample_fits(
        Budget(room - 1, encoder=0, head=head_nbytes(DIM, head_classes)), stores, DIM
    )


def _init(tmp_path, budget: int) -> list[str]:
    return [
        *("init", "--encoder", str(tmp_path / "enc.onnx"), "--data", str(tmp_path / "d.npz")),
        *("--input-spec", str(tmp_path / "spec.json"), "--budget", str(budget)),
        *("--out", str(tmp_path / "device")),
    ]


def test_init_refuses_below_one_sample_in_one_line_and_fits_at_the_smallest_budget(
    tmp_path, capsys
):
    encoder = make_image_encoder(tmp_path / "enc.onnx")
    x, y = make_images(30)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    (tmp_path / "spec.json").write_text(json.dumps(IMAGE_SPEC))
    stores = [make_datastore(r, NUM_CLASSES) for r in DEVICE_RECIPES]
    smallest = encoder.stat().st_size + one_sample_room(stores, P, None)
    capsys.readouterr()
    assert edge_cli.main(_init(tmp_path, smallest - 1)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert (
        f"budget {smallest - 1} bytes: the encoder takes {encoder.stat().st_size} bytes" in err
        and f"the smallest budget that holds one is {smallest} bytes" in err
    ), err
    assert not (tmp_path / "device").exists()
    assert edge_cli.main(_init(tmp_path, smallest)) == 0
    rt = Runtime.load(tmp_path / "device")
    assert len(rt.datastore) == 1 <= rt._max_fit()  # within the rule `add` holds it to
