"""The UTF-8 bytes of Arrow string arrays as NumPy arrays: a corpus's text worked on whole, with no
Python step per document (hashing it, counting what it holds, listing its characters).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np


def utf8_chunks(texts: Any) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(data, offsets)`` of each non-empty chunk of ``texts`` (an Arrow string or large-string
    array, or a chunked array): ``data`` the chunk's UTF-8 bytes (uint8, zero-copy), ``offsets``
    where each string starts in it, from 0, with the end last (int64; ``np.diff`` gives the
    strings' byte lengths)."""
    import pyarrow as pa

    chunks = texts.chunks if isinstance(texts, pa.ChunkedArray) else [texts]
    for chunk in (c for c in chunks if len(c)):
        kind = np.int64 if pa.types.is_large_string(chunk.type) else np.int32
        offsets = np.frombuffer(chunk.buffers()[1], dtype=kind)[chunk.offset : chunk.offset + len(chunk) + 1]
        offsets = offsets.astype(np.int64)
        data = chunk.buffers()[2]
        data = np.zeros(0, np.uint8) if data is None else np.frombuffer(data, dtype=np.uint8)
        yield data[offsets[0] : offsets[-1]], offsets - offsets[0]


_UTF8_LENGTH = np.array([1] * 0xC0 + [2] * 0x20 + [3] * 0x10 + [4] * 0x10, dtype=np.uint8)
"""A UTF-8 character's length in bytes by its lead byte (continuation bytes, 0x80-0xBF, lead nothing)."""
_KEEP = np.array([0, 0xFF000000, 0xFFFF0000, 0xFFFFFF00, 0xFFFFFFFF], dtype=np.uint32)
"""The bits of a big-endian 4-byte window that a character of 0-4 bytes occupies."""


def characters_in(data: np.ndarray) -> set[str]:
    """The distinct characters of the UTF-8 bytes ``data``, vectorized: the bytes counted (an ASCII
    byte is its character), and each multi-byte character's bytes packed into one 32-bit value at
    its lead byte (its length is in the lead byte) and those values made distinct (Arrow's hash
    ``unique``); only the distinct characters are decoded in Python. Arrow strings are valid UTF-8;
    a malformed sequence could only add a replacement character."""
    if data.size == 0:
        return set()
    byte_counts = np.bincount(data, minlength=256)
    found = {chr(b) for b in np.flatnonzero(byte_counts[:0x80]).tolist()}
    if not byte_counts[0xC0:].any():  # ASCII only (most English text): no multi-byte character
        return found
    import pyarrow as pa
    import pyarrow.compute as pc

    lead = np.flatnonzero(data >= 0xC0)
    windows = np.lib.stride_tricks.sliding_window_view(np.concatenate([data, np.zeros(3, np.uint8)]), 4)
    packed = windows[lead].view(">u4").ravel().astype(np.uint32) & _KEEP[_UTF8_LENGTH[data[lead]]]
    for value in pc.unique(pa.array(packed)).to_numpy().tolist():
        found.add(value.to_bytes(4, "big").rstrip(b"\0").decode("utf-8", "replace"))
    return found


def distinct_characters(arrays: Any) -> list[str]:
    """Every character that occurs in the Arrow string arrays ``arrays`` (an iterable of arrays or
    chunked arrays), sorted."""
    found: set[str] = set()
    for texts in arrays:
        for data, _ in utf8_chunks(texts):
            found |= characters_in(data)
    return sorted(found)


def plain_ascii(texts: Any) -> np.ndarray:
    """Whether each string of ``texts`` (an Arrow string array or chunked array) is plain ASCII:
    printable ASCII, tab, line feed and carriage return only (an empty string is). Vectorized over
    the UTF-8 bytes (~0.3 ns a byte): the bytes outside 0x20-0x7E are found in one comparison (the
    subtraction wraps the control bytes past the printable range), the strings that hold one other
    than the three kept from their positions."""
    import pyarrow as pa

    chunks = texts.chunks if isinstance(texts, pa.ChunkedArray) else [texts]
    out = np.ones(sum(len(c) for c in chunks), dtype=bool)
    start = 0
    for chunk in chunks:
        for data, offsets in utf8_chunks(chunk):
            at = np.flatnonzero((data - np.uint8(0x20)) >= 0x5F)  # < 0x20 or >= 0x7F
            byte = data[at]
            at = at[(byte != 0x09) & (byte != 0x0A) & (byte != 0x0D)]
            if at.size:
                out[start + np.searchsorted(offsets, at, side="right") - 1] = False
        start += len(chunk)
    return out
