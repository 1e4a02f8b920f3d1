"""What crosses the wire in Flower's own record types: a client's sums, its personalizations'
choices and kNN-Per's grid points survive Flower's serialization with their types, and a reply
whose arrays lie about their size, shape or dtype is refused with a clear error, never decoded
into a crash."""

from __future__ import annotations

import io

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict  # noqa: E402
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto  # noqa: E402
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # noqa: E402
from numpy.lib import format as npy  # noqa: E402

from edge_runtime.knn import LAMBDA_GRID, LambdaRule  # noqa: E402
from fed_train.flower.records import (  # noqa: E402
    check_shapes,
    counts_record,
    from_config_record,
    knn_choice_from,
    knn_choice_record,
    points_from_record,
    points_record,
    read_counts,
    to_config_record,
    to_weights,
)
from fed_train.knn_setting import KNNChoice, KNNConfig  # noqa: E402
from fed_train.knn_tuning import grid_points  # noqa: E402

SHAPE = (7, 3)


def _over_the_wire(record):
    """The record as the other side reads it: Flower's own serialization and back."""
    wire = recorddict_to_proto(RecordDict({"r": record})).SerializeToString()
    return recorddict_from_proto(ProtoRecordDict.FromString(wire))["r"]


def _npy_header(shape: tuple[int, ...], descr: str = "<f8") -> bytes:
    stream = io.BytesIO()
    npy.write_array_header_1_0(stream, {"descr": descr, "fortran_order": False, "shape": shape})
    return stream.getvalue()


def test_a_clients_sums_arrive_as_sent():
    counts = np.arange(21, dtype=np.float64).reshape(SHAPE)
    record = _over_the_wire(counts_record("knn-grid", counts))
    np.testing.assert_array_equal(read_counts(record, "knn-grid", SHAPE), counts)


@pytest.mark.parametrize(
    "array, message",
    [
        (Array(np.zeros(SHAPE, np.float32)), r"float32 \(7, 3\), not float64 \(7, 3\)"),
        (Array(np.zeros((8, 3))), r"float64 \(8, 3\), not float64 \(7, 3\)"),
        (Array(np.full(SHAPE, np.nan)), "not all finite and non-negative"),
        (Array(-np.ones(SHAPE)), "not all finite and non-negative"),
        # the declared shape is right, the payload is another array
        (
            Array("float64", SHAPE, "numpy.ndarray", Array(np.zeros((2, 3))).data),
            r"declares float64 \(7, 3\) but carries 48 bytes of float64 \(2, 3\)",
        ),
        # a header claiming terabytes: refused before np.load would allocate them
        (
            Array("float64", SHAPE, "numpy.ndarray", _npy_header((10**12, 3)) + bytes(168)),
            r"carries 168 bytes of float64 \(1000000000000, 3\)",
        ),
        (Array("float64", SHAPE, "numpy.ndarray", b""), "not an .npy payload"),
        (Array("float64", SHAPE, "numpy.ndarray", b"\x80\x04pickled"), "not an .npy payload"),
    ],
)
def test_sums_that_are_not_the_phases_shape_and_dtype_are_refused(array, message):
    record = _over_the_wire(ArrayRecord({"knn-grid": array}))
    with pytest.raises(ValueError, match=message):
        read_counts(record, "knn-grid", SHAPE)


def test_sums_for_another_phase_are_refused():
    record = counts_record("knn-l2", np.zeros(SHAPE))
    with pytest.raises(ValueError, match="no sums for knn-grid"):
        read_counts(record, "knn-grid", SHAPE)


def test_weights_whose_payload_disagrees_with_their_declaration_are_refused():
    record = ArrayRecord(
        {"w": Array("float32", (2,), "numpy.ndarray", _npy_header((10**12,), "<f4"))}
    )
    with pytest.raises(ValueError, match=r"w declares float32 \(2,\) but carries 0 bytes"):
        to_weights(_over_the_wire(record))


def test_weights_of_another_dtype_are_refused():
    model = {"w": np.zeros((2, 3), np.float32)}
    with pytest.raises(
        ValueError, match="client 1 sent w as float64, but this side's model holds float32"
    ):
        check_shapes({"w": np.zeros((2, 3))}, model, sender="client 1")


def test_choices_keep_their_types_and_order_across_the_wire():
    chosen = {
        "knnper": {"lambda": 0.3, "datastore_size": 299},
        "linear": {"l2": None, "head_bytes": 5160},
        "clustered": {"cluster": 1, "picked_on_validation": True},
        "fedavg": {},
    }
    back = from_config_record(_over_the_wire(to_config_record(chosen)))
    assert back == {m: c for m, c in chosen.items() if c}  # a method that chose nothing: absent
    for method, values in back.items():
        assert list(values) == list(chosen[method])
        assert [type(v) for v in values.values()] == [type(v) for v in chosen[method].values()]


def test_grid_points_travel_as_typed_columns():
    points = grid_points((5, 10), (0.5, 1.0), ("raw", "l2"))
    record = _over_the_wire(points_record(points))
    assert isinstance(record, ConfigRecord) and record["k"] == [5, 5, 10, 10] * 2
    assert points_from_record(record) == points


def test_grid_point_columns_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="shorter|longer"):
        points_from_record(
            ConfigRecord({"k": [5, 10], "sigma": [1.0], "normalize": ["raw", "raw"]})
        )


@pytest.mark.parametrize(
    "choice",
    [
        KNNChoice(),
        KNNChoice(
            KNNConfig(5, 0.01, "l2"),
            "loo+val",
            lambda_rule=LambdaRule("shrunk", tuple((3.0, 2.5, 4.0) for _ in LAMBDA_GRID), 8.0),
            base="linear",
            l2=0.1,
        ),
    ],
)
def test_the_knn_choice_travels_as_named_scalars_and_arrives_as_one(choice):
    """It was one JSON string ("knn"), read back into nine keyword arguments."""
    record = knn_choice_record(choice)
    assert all(isinstance(v, (int, float, str, list)) for v in record.values())
    assert record["knn-k"] == choice.config.k and record["knn-base"] == choice.base
    arrived = knn_choice_from(ConfigRecord({**_over_the_wire(record), "unseen": False}))
    assert arrived == KNNChoice(
        choice.config, choice.lambda_estimator, lambda_rule=choice.lambda_rule,
        base=choice.base, l2=choice.l2,
    )  # fmt: skip
    assert knn_choice_from(ConfigRecord({"unseen": False})) is None  # no kNN-Per evaluated


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("knn-lambda-pooled", [1.0, 2.0], "cannot reshape"),
        ("knn-k", 0, "k must be an integer"),
        ("knn-l2", 0.1, "base must be 'global'"),
    ],
)
def test_a_knn_choice_record_that_no_device_could_run_is_refused(field, value, message):
    record = knn_choice_record(KNNChoice())
    record[field] = value
    with pytest.raises(ValueError, match=f"^the server's kNN-Per setting: .*{message}"):
        knn_choice_from(record)
