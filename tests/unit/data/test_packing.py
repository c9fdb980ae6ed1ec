"""MLM-only packing: full-length [CLS] ... [SEP] rows, documents joined by [SEP], nothing lost."""

from __future__ import annotations

import numpy as np
import pytest

from bert_mp.data.packing import pack_documents

CLS, SEP = 2, 3


def test_rows_are_full_length_and_keep_every_token_in_order():
    docs = [list(range(100, 137)), list(range(200, 205)), list(range(300, 361))]
    flat = np.array([t for d in docs for t in d], dtype=np.int32)
    ids, offsets = pack_documents(flat, np.array([len(d) for d in docs]), 16, CLS, SEP)
    rows = [ids[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    assert all(len(r) == 16 for r in rows[:-1]) and 3 <= len(rows[-1]) <= 16
    assert all(r[0] == CLS and r[-1] == SEP for r in rows)
    body = [t for r in rows for t in r[1:-1]]
    # the documents in order with one [SEP] between consecutive documents, none after the last
    assert body == docs[0] + [SEP] + docs[1] + [SEP] + docs[2]


def test_a_single_short_document_and_no_documents():
    ids, offsets = pack_documents(np.array([7, 8, 9]), np.array([3]), 128, CLS, SEP)
    assert ids.tolist() == [CLS, 7, 8, 9, SEP] and offsets.tolist() == [0, 5]
    ids, offsets = pack_documents(np.zeros(0, np.int32), np.zeros(0, np.int64), 128, CLS, SEP)
    assert ids.size == 0 and offsets.tolist() == [0]
    with pytest.raises(ValueError, match="no room"):
        pack_documents(np.array([7]), np.array([1]), 2, CLS, SEP)
