"""Refuse ONNX models that keep tensors in external data files, without needing the onnx package.

onnxruntime resolves an external-data location against the model's directory, or against the
current working directory when the model comes from bytes: either way it reads files the bundle's
sha256 list never covered. A bundle's encoder must embed every tensor, so this walks the model's
protobuf (only the messages that can hold tensors) and reports the first external one.
"""

from __future__ import annotations

# For each message kind, the fields that hold nested messages (field number -> kind).
_CHILDREN: dict[str, dict[int, str]] = {
    "model": {7: "graph", 20: "training", 25: "function"},
    "training": {1: "graph", 2: "graph"},
    "graph": {1: "node", 5: "tensor", 15: "sparse"},
    "function": {7: "node"},
    "node": {5: "attribute"},
    "attribute": {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"},
    "sparse": {1: "tensor", 2: "tensor"},
    "tensor": {},
}
_TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION, _EXTERNAL = 13, 14, 1
_MAX_DEPTH = 64


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def uses_external_data(model: bytes) -> bool:
    """Whether any tensor of the serialized ModelProto `model` lives in an external data file.
    ValueError when the bytes are not a well-formed protobuf (onnxruntime would refuse them too)."""
    stack = [("model", 0, len(model), 0)]
    while stack:
        kind, pos, end, depth = stack.pop()
        if depth > _MAX_DEPTH:
            raise ValueError(f"graphs nested more than {_MAX_DEPTH} deep")
        children = _CHILDREN[kind]
        while pos < end:
            key, pos = _varint(model, pos, end)
            field, wire = key >> 3, key & 7
            if wire == 0:
                value, pos = _varint(model, pos, end)
                if kind == "tensor" and field == _TENSOR_DATA_LOCATION and value == _EXTERNAL:
                    return True
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            elif wire == 2:
                length, pos = _varint(model, pos, end)
                if pos + length > end:
                    raise ValueError("a field runs past the end of its message")
                if kind == "tensor" and field == _TENSOR_EXTERNAL_DATA:
                    return True
                if field in children:
                    stack.append((children[field], pos, pos + length, depth + 1))
                pos += length
            else:
                raise ValueError(f"unsupported protobuf wire type {wire}")
            if pos > end:
                raise ValueError("a field runs past the end of its message")
    return False
