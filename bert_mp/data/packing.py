"""MLM-only examples: documents packed into full-length sequences (``data.objective=mlm``).

The tokens of a block's documents, in document order, with one ``[SEP]`` between consecutive
documents, are cut into runs of ``max_seq_length - 2`` tokens; each run becomes
``[CLS] run [SEP]``. Every example but the block's last is full length: no padding, no NSP label
(RoBERTa's FULL-SENTENCES without the sentence-boundary constraint, i.e. ``run_mlm.py``'s
``group_texts``; a run may start or end inside a sentence, and, rarely, right at a document
separator). There is no randomness: the examples are a function of the block's tokens alone.

Also the load-time packing of examples into rows: ``data.pack_pairs`` (:func:`pack_rows`) and
``data.token_budget`` (:func:`fill_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pack_documents(
    flat: np.ndarray, doc_lengths: np.ndarray, max_seq_length: int, cls_id: int, sep_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Pack documents (``flat`` split by ``doc_lengths``, none empty) into ``[CLS] ... [SEP]`` rows.

    Returns ``(input_ids, offsets)``: example ``k`` is ``input_ids[offsets[k]:offsets[k + 1]]``,
    at most ``max_seq_length`` long.
    """
    if max_seq_length < 3:
        raise ValueError(f"max_seq_length={max_seq_length} leaves no room for text next to [CLS] and [SEP]")
    doc_lengths = np.asarray(doc_lengths, dtype=np.int64)
    if doc_lengths.size == 0:
        return np.zeros(0, dtype=np.int32), np.zeros(1, dtype=np.int64)
    assert (doc_lengths > 0).all() and int(doc_lengths.sum()) == len(flat)
    stream = np.insert(flat.astype(np.int32, copy=False), np.cumsum(doc_lengths)[:-1], sep_id)
    body = max_seq_length - 2
    n = len(stream)
    n_examples = -(-n // body)
    lengths = np.minimum(body, n - np.arange(n_examples, dtype=np.int64) * body) + 2
    offsets = np.zeros(n_examples + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    out = np.empty(int(offsets[-1]), dtype=np.int32)
    # token t of the stream sits in example t // body, after that example's [CLS] and the two
    # special tokens of every example before it
    t = np.arange(n, dtype=np.int64)
    out[t + 2 * (t // body) + 1] = stream
    out[offsets[:-1]] = cls_id
    out[offsets[1:] - 1] = sep_id
    return out, offsets


def pack_rows(lengths: list[int], max_seq_length: int) -> list[list[int]]:
    """Group examples (by their ``lengths``, in order) into rows of at most ``max_seq_length`` tokens.

    First fit: each example goes into the first row with room, else opens a new row; rows and the
    examples within a row keep the input order. Deterministic, so a packed batch is a function of
    its examples. Used by ``data.pack_pairs`` to put several short NSP pairs into one row.
    """
    rows: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        if n > max_seq_length:
            raise ValueError(f"example {i} has {n} tokens, more than max_seq_length={max_seq_length}")
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(max_seq_length - n)
    return rows


def examples_per_row(max_seq_length: int) -> int:
    """The most examples one row of ``data.token_budget`` holds: ``max(2, max_seq_length // 32)``.

    A fixed bound, so the NSP rows (one ``[CLS]`` per example) and the masked-token gather have one
    size per micro-batch whatever the examples' lengths."""
    return max(2, max_seq_length // 32)


def fill_rows(lengths: Sequence[int], rows: int, length: int, per_row: int) -> list[list[int]]:
    """The longest prefix of ``lengths`` that fits ``rows`` rows of ``length`` tokens, first fit.

    Each example (in order) goes into the first row with room for it and fewer than ``per_row``
    examples; the first one that fits nowhere ends the prefix (it and the rest are not placed). Returns
    the positions in ``lengths`` per row (empty rows included); a prefix's placement does not depend
    on what follows it, so placing the prefix alone gives the same rows. ``data.token_budget``.
    """
    room = np.full(rows, length, dtype=np.int64)
    count = np.zeros(rows, dtype=np.int64)
    placed: list[list[int]] = [[] for _ in range(rows)]
    for i, n in enumerate(lengths):
        if n > length:
            raise ValueError(f"example {i} has {n} tokens, more than max_seq_length={length}")
        fits = (room >= n) & (count < per_row)
        r = int(fits.argmax())
        if not fits[r]:
            break
        room[r] -= n
        count[r] += 1
        placed[r].append(i)
    return placed


def document_segments(
    input_ids: np.ndarray, attention_mask: np.ndarray, sep_id: int, segment_ids: np.ndarray | None = None
) -> np.ndarray:
    """Segment ids 1, 2, ... per document of each row (0 on padding), read from the ``[SEP]`` tokens.

    For ``data.mlm_document_attention=block``: in a row packed by :func:`pack_documents`, a ``[SEP]``
    followed by a real token other than ``[SEP]`` ends a document (the ``[SEP]`` stays with the
    document it closes; the row's final ``[SEP]`` stays with the last one, also when a document ends
    right before it). A change of ``segment_ids`` (rows packed by ``data.pack_pairs``) starts a new one
    too. Derived at collate time, so the prepared data is unchanged.
    """
    ids = np.asarray(input_ids)
    real = np.asarray(attention_mask) != 0
    start = np.zeros(ids.shape, dtype=bool)
    start[:, 1:] = real[:, 1:] & (ids[:, :-1] == sep_id) & (ids[:, 1:] != sep_id)
    if segment_ids is not None:
        seg = np.asarray(segment_ids)
        start[:, 1:] |= real[:, 1:] & (seg[:, 1:] != seg[:, :-1])
    return np.where(real, np.cumsum(start, axis=1) + 1, 0).astype(np.int64)
