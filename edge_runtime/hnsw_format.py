"""Structure check of an hnswlib index file before hnswlib reads it.

hnswlib's loader trusts its file: an entry point or a neighbour id out of range, a link count
past the list's room, or record sizes that disagree with the dimension make it read outside its
buffers later, at query time (SIGSEGV, not an exception). This module reads the layout that
hnswlib's `HierarchicalNSW::saveIndex` writes (hnswlib 0.7-0.8) and refuses any file that
hnswlib could not search safely, so a crafted `hnsw.bin` that passes the sha256 check ends in a
ValueError instead of a crash.

Layout (little-endian, size_t = 8 bytes, tableint = uint32):
    header   offsetLevel0 max_elements cur_element_count size_data_per_element label_offset
             offsetData (size_t each) maxlevel (int32) enterpoint (uint32) maxM maxM0 M (size_t)
             mult (float64) ef_construction (size_t)
    level 0  cur_element_count records of size_data_per_element bytes:
             [link count (uint16) + flags (uint16)] [maxM0 neighbour ids] [dim float32] [label]
    upper    per element: uint32 byte size, then level * (maxM + 1) uint32: per level a count
             and maxM neighbour ids
"""

from __future__ import annotations

import io
import math
import os
import struct
from typing import BinaryIO

import numpy as np

_HEADER = struct.Struct("<QQQQQQiIQQQdQ")
_MAX_M = 10_000  # hnswlib warns above this; no real index comes near it


# Level-0 records are checked this many bytes at a time, so the check never holds the file.
_CHUNK_BYTES = 4 << 20


def check_hnsw_index(
    source: bytes | str | os.PathLike, dim: int, name: str = "hnsw.bin"
) -> np.ndarray:
    """Validate an hnswlib l2/float32 index of dimension `dim` (its bytes, or its path, which
    is read a chunk at a time); returns its labels (uint64).

    ValueError (one line naming `name`) unless: the header's sizes are the ones hnswlib derives
    from M and dim; the file has exactly the records it declares; no memory is reserved beyond
    the stored elements; no element is marked deleted; every link list fits its room and names
    existing elements that live on that level; the entry point is an element on the top level.
    """
    if isinstance(source, bytes):
        return _check(io.BytesIO(source), len(source), dim, name)
    with open(source, "rb") as f:
        return _check(f, os.fstat(f.fileno()).st_size, dim, name)


def _check(f: BinaryIO, size: int, dim: int, name: str) -> np.ndarray:
    def fail(problem: str) -> ValueError:
        return ValueError(f"{name} is not a valid hnswlib index: {problem}")

    header = f.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise fail(f"{size} bytes is shorter than the header")
    (
        offset_level0,
        max_elements,
        count,
        per_element,
        label_offset,
        offset_data,
        max_level,
        entry_point,
        max_m,
        max_m0,
        m,
        mult,
        _ef_construction,
    ) = _HEADER.unpack(header)
    if not 2 <= m <= _MAX_M or max_m != m or max_m0 != 2 * m:
        raise fail(f"M={m}, maxM={max_m}, maxM0={max_m0} (hnswlib sets maxM=M, maxM0=2M)")
    if not (math.isfinite(mult) and abs(mult - 1.0 / math.log(m)) <= 1e-9 * mult):
        raise fail(f"level multiplier {mult!r} is not 1/ln(M)")
    links0 = 4 + 4 * max_m0
    expected = (0, links0, links0 + 4 * dim, links0 + 4 * dim + 8)
    if (offset_level0, offset_data, label_offset, per_element) != expected:
        raise fail(
            f"record layout (offsets {offset_level0}, {offset_data}, {label_offset}, size "
            f"{per_element}) is not that of dimension {dim} with M={m}"
        )
    if count < 1 or max_elements != count:
        raise fail(
            f"it holds {count} elements and reserves room for {max_elements} (a bundle's "
            "index holds at least one element and reserves no more than it holds)"
        )
    level0_end = _HEADER.size + count * per_element
    if level0_end > size:
        raise fail(f"{count} records of {per_element} bytes do not fit in {size} bytes")
    # the upper levels (about 1/M of the elements) come after level 0, which needs them
    f.seek(level0_end)
    levels, upper = _upper_levels(f.read(size - level0_end), 0, count, 4 + 4 * max_m, fail)
    for level, (owners, lists) in upper.items():
        _check_links(lists, level, owners, max_m, count, levels, fail)
    del upper

    labels = np.empty(count, np.uint64)
    rows = max(1, _CHUNK_BYTES // per_element)
    f.seek(_HEADER.size)
    for start in range(0, count, rows):
        stop = min(count, start + rows)
        chunk = f.read((stop - start) * per_element)
        if len(chunk) != (stop - start) * per_element:
            raise fail("the file changed while it was read")
        records = np.frombuffer(chunk, np.uint8).reshape(stop - start, per_element)
        heads = records[:, :links0].copy().view("<u4")
        _check_links(heads, 0, np.arange(start, stop), max_m0, count, levels, fail)
        if np.any(heads[:, 0] >> 16):
            raise fail("elements are marked deleted (a bundle's index is saved compact)")
        vectors = records[:, offset_data:label_offset].copy().view("<f4")
        if not np.all(np.isfinite(vectors)):
            raise fail("stored vectors hold NaN or infinite values")
        labels[start:stop] = records[:, label_offset:per_element].copy().view("<u8").ravel()

    top = int(levels.max())
    if not 0 <= entry_point < count or max_level != top or levels[entry_point] != top:
        raise fail(
            f"entry point {entry_point} on level {max_level} is not an element of the top level "
            f"{top}"
        )
    if np.unique(labels).size != count:
        raise fail("two elements share a label")
    return labels


def _upper_levels(data: bytes, start: int, count: int, block: int, fail):
    """Per element its level; per level >= 1 the (element ids, link blocks [n, maxM + 1])."""
    levels = np.zeros(count, np.int64)
    blocks: dict[int, list[tuple[int, bytes]]] = {}
    pos = start
    for i in range(count):
        if pos + 4 > len(data):
            raise fail("the upper-level link lists are cut short")
        (size,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if size % block or pos + size > len(data):
            raise fail(f"element {i}'s upper-level link lists ({size} bytes) are malformed")
        levels[i] = size // block
        for level in range(1, levels[i] + 1):
            off = pos + (level - 1) * block
            blocks.setdefault(level, []).append((i, data[off : off + block]))
        pos += size
    if pos != len(data):
        raise fail(f"{len(data) - pos} bytes follow the last link list")
    upper = {
        level: (
            np.array([i for i, _ in items], np.int64),
            np.frombuffer(b"".join(b for _, b in items), "<u4").reshape(len(items), -1),
        )
        for level, items in blocks.items()
    }
    return levels, upper


def _check_links(lists, level, owners, room, count, levels, fail) -> None:
    """Each row: [count | flags, ids...]; count <= room, ids of elements living on `level`."""
    sizes = (lists[:, 0] & 0xFFFF).astype(np.int64)
    if level > 0 and np.any(lists[:, 0] >> 16):
        raise fail(f"level {level} link lists carry flags")
    if np.any(sizes > room):
        bad = int(owners[np.argmax(sizes > room)])
        raise fail(f"element {bad} has more than {room} links on level {level}")
    used = np.arange(room)[None, :] < sizes[:, None]
    ids = lists[:, 1 : room + 1][used].astype(np.int64)
    if ids.size and (ids.max() >= count or np.any(levels[ids] < level)):
        raise fail(f"a level-{level} link names an element that is not on that level")
