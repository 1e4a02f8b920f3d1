"""ONNX models written and read at the protobuf wire level, so the device can build its
one-session predictor without the onnx package (which the device does not install).

Only what the predictor needs: tensors with raw data, nodes with int / float / ints / floats /
tensor attributes, typed graph inputs and outputs, a model with opsets and metadata; to
inline an encoder, its top-level fields split apart and its input renamed in the nodes that
read it; and, for a device that refits its linear head, named initializers replaced by arrays
of the same type and shape. Field numbers are those of onnx/onnx.proto (stable since IR version 3).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

# A protobuf message as bytes, or a view into a larger one (see `fields`).
Buffer = bytes | memoryview

# TensorProto.DataType
FLOAT, UINT8, INT8, INT32, INT64, FLOAT16, DOUBLE = 1, 2, 3, 6, 7, 10, 11
_DTYPES = {
    np.dtype(np.float32): FLOAT,
    np.dtype(np.uint8): UINT8,
    np.dtype(np.int8): INT8,
    np.dtype(np.int32): INT32,
    np.dtype(np.int64): INT64,
    np.dtype(np.float16): FLOAT16,
    np.dtype(np.float64): DOUBLE,
}
_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64 fields: two's complement, ten bytes
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _bytes(field: int, data: Buffer) -> bytes:
    return _key(field, _BYTES) + _varint(len(data)) + data


def _str(field: int, text: str) -> bytes:
    return _bytes(field, text.encode("utf-8"))


def _int(field: int, value: int) -> bytes:
    return _key(field, _VARINT) + _varint(int(value))


def _float(field: int, value: float) -> bytes:
    return _key(field, _FIXED32) + struct.pack("<f", value)


def tensor_type(dtype: np.dtype) -> int:
    """The TensorProto data type of a numpy dtype."""
    kind = _DTYPES.get(np.dtype(dtype))
    if kind is None:
        raise ValueError(f"no ONNX tensor type for dtype {dtype}")
    return kind


def tensor(name: str, array: np.ndarray) -> bytes:
    """TensorProto: dims (1), data_type (2), name (8), raw_data (9, little-endian)."""
    array = np.asarray(array)
    kind = tensor_type(array.dtype)
    dims = b"".join(_int(1, d) for d in array.shape)
    data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    return dims + _int(2, kind) + _str(8, name) + _bytes(9, data)


def _attribute(name: str, value) -> bytes:
    """AttributeProto: name (1), f (2), i (3), t (5), floats (7), ints (8), type (20)."""
    head = _str(1, name)
    if isinstance(value, bool) or isinstance(value, (int, np.integer)):
        return head + _int(3, int(value)) + _int(20, 2)
    if isinstance(value, (float, np.floating)):
        return head + _float(2, float(value)) + _int(20, 1)
    if isinstance(value, np.ndarray):
        return head + _bytes(5, tensor("", value)) + _int(20, 4)
    values = list(value)
    if values and all(isinstance(v, (int, np.integer)) for v in values):
        return head + b"".join(_int(8, v) for v in values) + _int(20, 7)
    return head + b"".join(_float(7, float(v)) for v in values) + _int(20, 6)


def node(
    op: str, inputs: Sequence[str], outputs: Sequence[str], *, domain: str = "", **attrs
) -> bytes:
    """NodeProto: input (1), output (2), op_type (4), attribute (5), domain (7)."""
    out = b"".join(_str(1, name) for name in inputs)
    out += b"".join(_str(2, name) for name in outputs) + _str(4, op)
    out += b"".join(_bytes(5, _attribute(k, v)) for k, v in attrs.items())
    return out + (_str(7, domain) if domain else b"")


def value_info(name: str, elem_type: int, shape: Sequence[int | str | None] | None) -> bytes:
    """ValueInfoProto of a tensor; a str dimension is symbolic, None unknown."""
    dims = b""
    for d in shape or ():
        if isinstance(d, str):
            dims += _bytes(1, _str(2, d))
        elif d is None:
            dims += _bytes(1, b"")
        else:
            dims += _bytes(1, _int(1, d))
    tensor_type = _int(1, elem_type) + (_bytes(2, dims) if shape is not None else b"")
    return _str(1, name) + _bytes(2, _bytes(1, tensor_type))


def nodes(items: Sequence[bytes]) -> bytes:
    """GraphProto's node fields (1): graphs are built in parts that are concatenated."""
    return b"".join(_bytes(1, n) for n in items)


def graph(
    name: str,
    items: Sequence[bytes],
    inputs: Sequence[bytes],
    outputs: Sequence[bytes],
    initializers: Sequence[bytes] = (),
    *,
    prefix: Sequence[Buffer] = (),
) -> bytes:
    """GraphProto: node (1), name (2), initializer (5), input (11), output (12); `prefix` (graph
    fields, e.g. an inlined graph's nodes) goes first, so nodes stay in topological order.
    Joined once: an inlined encoder's bytes are copied once, not once per part."""
    return b"".join(
        [
            *prefix,
            nodes(items),
            _str(2, name),
            *(_bytes(5, t) for t in initializers),
            *(_bytes(11, v) for v in inputs),
            *(_bytes(12, v) for v in outputs),
        ]
    )


def model(
    graph_bytes: bytes,
    *,
    ir_version: int,
    opsets: Mapping[str, int],
    producer: str,
    metadata: Mapping[str, str] | None = None,
) -> bytes:
    """ModelProto: ir_version (1), producer_name (2), graph (7), opset_import (8),
    metadata_props (14)."""
    parts = [_int(1, ir_version), _str(2, producer)]
    parts += [_key(7, _BYTES), _varint(len(graph_bytes)), graph_bytes]  # not copied twice
    for domain, version in opsets.items():
        parts.append(_bytes(8, (_str(1, domain) if domain else b"") + _int(2, version)))
    for key, value in (metadata or {}).items():
        parts.append(_bytes(14, _str(1, key) + _str(2, value)))
    return b"".join(parts)


# ----------------------------------------------------------------------------- reading


def fields(data: Buffer) -> Iterator[tuple[int, int, int | memoryview, memoryview]]:
    """(field number, wire type, value, the field's raw bytes) of one message's top level.
    Length-delimited values and the raw bytes are views into `data`, not copies: an encoder's
    graph is read without holding it twice (what a device holds at load counts)."""
    view, pos, end = memoryview(data), 0, len(data)
    while pos < end:
        start = pos
        tag, pos = _read_varint(view, pos)
        field, wire = tag >> 3, tag & 7
        if wire == _VARINT:
            value, pos = _read_varint(view, pos)
        elif wire == _BYTES:
            size, pos = _read_varint(view, pos)
            if pos + size > end:
                raise ValueError("a length-delimited field runs past the message")
            value, pos = view[pos : pos + size], pos + size
        elif wire in (_FIXED32, _FIXED64):
            width = 4 if wire == _FIXED32 else 8
            value, pos = int.from_bytes(view[pos : pos + width], "little"), pos + width
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if pos > end:
            raise ValueError("a field runs past the message")
        yield field, wire, value, view[start:pos]


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(view) or shift > 63:
            raise ValueError("malformed varint")
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _name(message: Buffer, field: int = 1) -> str:
    for number, wire, value, _ in fields(message):
        if number == field and wire == _BYTES:
            return str(value, "utf-8")
    return ""


class ParsedModel:
    """The parts of a ModelProto an inlining needs: ir_version, opsets, its metadata, and the
    graph's raw fields, its real inputs (those that are not initializers) and its output names."""

    def __init__(self, data: bytes) -> None:
        self.ir_version, self.opsets, graph_bytes = 0, {}, None
        self.functions = b""  # model-local functions (25), kept as they are
        self.metadata: dict[str, str] = {}
        for number, _, value, raw in fields(data):
            if number == 25:
                self.functions += raw
            elif number == 14:
                entry = {f: str(v, "utf-8") for f, _, v, _ in fields(value)}
                self.metadata[entry.get(1, "")] = entry.get(2, "")
            elif number == 1:
                self.ir_version = int(value)
            elif number == 7:
                graph_bytes = value
            elif number == 8:
                domain, version = "", 1
                for f, _, v, _ in fields(value):
                    domain = str(v, "utf-8") if f == 1 else domain
                    version = int(v) if f == 2 else version
                self.opsets[domain] = version
        if graph_bytes is None:
            raise ValueError("the model has no graph")
        self.graph_fields = list(fields(graph_bytes))
        initializers = {_name(v, 8) for f, _, v, _ in self.graph_fields if f == 5}
        self.inputs = [
            _name(v) for f, _, v, _ in self.graph_fields if f == 11 and _name(v) not in initializers
        ]
        self.outputs = [_name(v) for f, _, v, _ in self.graph_fields if f == 12]

    def graph_body(self, rename_input: tuple[str, str]) -> list[Buffer]:
        """The graph's nodes, initializers and value infos (not its name, inputs or outputs),
        as graph fields for `graph(prefix=...)` (views into the model's bytes where unchanged),
        with every node input named rename_input[0] renamed to rename_input[1]. Nodes with
        subgraphs are refused: their inner references would not be renamed."""
        old, new = rename_input
        out: list[Buffer] = []
        for number, _, value, raw in self.graph_fields:
            if number == 1:
                out.append(_bytes(1, _renamed_node(value, old, new)))
            elif number in (5, 13, 14, 15):  # initializer, value_info, quantization, sparse
                out.append(raw)
        return out


def _renamed_node(message: Buffer, old: str, new: str) -> bytes:
    parts = []
    for number, _, value, raw in fields(message):
        if number == 5 and any(f in (6, 11) for f, _, _, _ in fields(value)):
            raise ValueError("the encoder has control-flow subgraphs; they cannot be inlined")
        if number == 1 and str(value, "utf-8") == old:
            parts.append(_str(1, new))
        else:
            parts.append(raw)
    return b"".join(parts)


def replace_initializers(model: bytes, arrays: Mapping[str, np.ndarray]) -> bytes:
    """The model with each named graph initializer's value replaced by `arrays[name]`, which
    must have the initializer's type and shape (so the model's size and its graph's meaning
    stay as they were). ValueError when a name is missing or its tensor differs in either."""
    missing = set(arrays)
    out = []
    for number, _, value, raw in fields(model):
        if number != 7:
            out.append(raw)
            continue
        graph_parts = []
        for g_number, _, g_value, g_raw in fields(value):
            name = _name(g_value, 8) if g_number == 5 else None
            if name in arrays:
                new = np.asarray(arrays[name])
                dims, kind = _tensor_type(g_value)
                if kind != _DTYPES.get(new.dtype) or dims != new.shape:
                    raise ValueError(
                        f"initializer {name!r} is {dims} of type {kind}, not "
                        f"{new.shape} {new.dtype}"
                    )
                g_raw = _bytes(5, tensor(name, new))
                missing.discard(name)
            graph_parts.append(g_raw)
        out.append(_bytes(7, b"".join(graph_parts)))
    if missing:
        raise ValueError(f"the model has no initializer {sorted(missing)[0]!r}")
    return b"".join(out)


def _tensor_type(message: Buffer) -> tuple[tuple[int, ...], int]:
    """A TensorProto's (dims, data_type); dims written packed or one field each."""
    dims: list[int] = []
    kind = 0
    for number, wire, value, _ in fields(message):
        if number == 1 and wire == _VARINT:
            dims.append(int(value))
        elif number == 1 and wire == _BYTES:
            view, pos = memoryview(value), 0
            while pos < len(view):
                dim, pos = _read_varint(view, pos)
                dims.append(dim)
        elif number == 2:
            kind = int(value)
    return tuple(dims), kind
