"""The tokenizer of a prepared folder: ``data.tokenizer`` loaded, or a WordPiece tokenizer learned from
a bounded sample of the corpus's training documents (``data.vocab_sample_chars``) and kept under
``<cache_dir>/tokenizers/`` keyed by the sample's text.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from bert_mp.core.config import DataConfig
from bert_mp.core.process.hold import hold
from bert_mp.core.storage.disk import write_folder_atomically
from bert_mp.data import allocator
from bert_mp.data.arrow_text import distinct_characters, utf8_chunks
from bert_mp.data.prepare.blocks import hash_uniform
from bert_mp.data.tokenizer import load_tokenizer, save_tokenizer, train_wordpiece

SAMPLE_STRATA = 1000
"""Stretches of equal characters (in reading order) that the vocabulary sample is drawn across."""
_STREAM_SAMPLE = 4
"""The sample's stream of :func:`~bert_mp.data.prepare.blocks.hash_uniform` (the splits' is 3)."""


def vocabulary_sample(doc_ids: np.ndarray, chars: np.ndarray, budget: int | None, seed: int) -> np.ndarray:
    """The documents (of the ascending ``doc_ids``; ``chars[i]`` characters each) a vocabulary is
    learned from, ascending: all of them when they hold at most ``budget`` characters (or ``budget``
    is None), else a sample of about ``budget`` characters across the whole corpus.

    The documents in reading order are cut into :data:`SAMPLE_STRATA` stretches of equal characters,
    and each stretch gives its share of the sample: its documents in the order of a hash of
    ``(seed, document index)``, until the sample's characters reach the budget's share of the corpus
    up to the stretch's end. So every part of the corpus (every file of more than a thousandth of
    it) contributes, the sample overshoots the budget by less than one document, and it depends on
    the seed, the budget and the documents' indices and lengths only: the same on every run and on
    every machine that holds the same corpus.
    """
    doc_ids = np.asarray(doc_ids, dtype=np.int64)
    c = chars[doc_ids].astype(np.int64)
    total = int(c.sum())
    if budget is None or total <= budget:
        return doc_ids
    strata = min(SAMPLE_STRATA, doc_ids.size)
    stratum = np.minimum((np.cumsum(c) - c) * strata // total, strata - 1)
    order = np.lexsort((hash_uniform(seed, _STREAM_SAMPLE, doc_ids), stratum))
    bounds = np.searchsorted(stratum[order], np.arange(strata + 1))
    goals = budget * np.cumsum(np.bincount(stratum, weights=c, minlength=strata)) / total
    taken, keep = 0, []
    for k in range(strata):
        need, idx = goals[k] - taken, order[bounds[k] : bounds[k + 1]]
        if need <= 0 or idx.size == 0:  # (a stretch inside one long document holds none)
            continue
        run = np.cumsum(c[idx])
        n = min(int(np.searchsorted(run, need)) + 1, idx.size)
        keep.append(idx[:n])
        taken += int(run[n - 1])
    return np.sort(doc_ids[np.concatenate(keep)])


def sample_texts(table: pa.Table, ids: np.ndarray) -> Iterator[pa.Array]:
    """The ``text`` of the rows ``ids`` (ascending), one Arrow array per chunk of the table that
    holds some: a chunk whose rows are all wanted as it is, else the rows taken from it alone (a
    take across chunks would concatenate them: a copy of the corpus)."""
    ids = np.asarray(ids, dtype=np.int64)
    start = 0
    for chunk in table.column("text").chunks:
        end = start + len(chunk)
        lo, hi = np.searchsorted(ids, [start, end])
        if hi - lo == len(chunk) and hi > lo:
            yield chunk
        elif hi > lo:
            yield chunk.take(pa.array(ids[lo:hi] - start))
        start = end


def training_text_digest(table: pa.Table, ids: np.ndarray) -> str:
    """sha256 of what WordPiece training reads: the text and length of each document ``ids``
    (ascending), in order (their Arrow buffers hashed as they are: no Python work per document)."""
    text, lengths = hashlib.sha256(), [np.zeros(0, "<i8")]
    for array in sample_texts(table, ids):
        for data, offsets in utf8_chunks(array):
            text.update(data)
            lengths.append(np.diff(offsets).astype("<i8"))
    parts = {
        "text": text.hexdigest(),
        "lengths": hashlib.sha256(np.concatenate(lengths).tobytes()).hexdigest(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def tokenizer_cache_path(data: DataConfig, text_digest: str) -> Path:
    """Where a tokenizer trained for this config is kept: keyed by its training text
    (:func:`training_text_digest`) and vocabulary settings, so every data config whose training
    documents are the same bytes shares it, and no other does. ``trainer`` names the training
    procedure: a tokenizer the stock, unreproducible trainer left in a cache is not reused (see
    :func:`bert_mp.data.tokenizer.train_wordpiece`)."""
    inputs = {
        "text": text_digest,
        "vocab_size": data.vocab_size,
        "lowercase": data.lowercase,
        "trainer": "wordpiece, continuing pieces registered in sorted order",
    }
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    return Path(data.cache_dir) / "tokenizers" / key


def _publish_tokenizer(tokenizer: Any, path: Path) -> None:
    """The tokenizer saved into ``path`` through a temporary folder named for this process (an error
    or a Ctrl-C removes it; a SIGTERM, which does not unwind, has :func:`remove_own_tokenizer_tmp`)."""

    def write(tmp: Path) -> None:
        save_tokenizer(tokenizer, tmp)
        hold("tokenizer", "written")  # tests only: stop here until signalled

    write_folder_atomically(
        path,
        write,
        "the tokenizer",
        None,
        lambda: "free disk space and run bert-mp prepare again",
        tmp=path.parent / f".tmp-{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
    )


def remove_own_tokenizer_tmp(data: DataConfig) -> None:
    """A SIGTERM exits at once, without unwinding: remove this process's temporary tokenizer folder."""
    for tmp in (Path(data.cache_dir) / "tokenizers").glob(f".tmp-*-{os.getpid()}-*"):
        shutil.rmtree(tmp, ignore_errors=True)


def tokenizer_for(
    data: DataConfig, table: pa.Table, train_ids: np.ndarray | None, chars: np.ndarray, force: bool
) -> tuple[Any, str, dict | None]:
    """``data.tokenizer`` loaded, or a WordPiece tokenizer learned from :func:`vocabulary_sample` of
    the training documents ``train_ids`` of ``table`` (``chars``: every row's characters), kept and
    reused by every data config whose sample is the same text (:func:`tokenizer_cache_path`); where it
    came from, and what the sample was (for ``stats.json``; None for a given tokenizer, which needs no
    ``train_ids``)."""
    if data.tokenizer:
        return load_tokenizer(data.tokenizer, data.max_seq_length), data.tokenizer, None
    assert train_ids is not None, "a vocabulary learned from no training documents"
    t0, cpu0 = time.perf_counter(), time.process_time()
    ids = vocabulary_sample(train_ids, chars, data.vocab_sample_chars, data.seed)
    shared = tokenizer_cache_path(data, training_text_digest(table, ids))
    record = {
        "sample_chars": data.vocab_sample_chars,
        "seed": data.seed,
        "whole": ids.size == train_ids.size,
        "documents": int(ids.size),
        "of_documents": int(train_ids.size),
        "characters": int(chars[ids].sum()),
        "of_characters": int(chars[train_ids].sum()),
        "reused": False,
        "seconds": {"sample": time.perf_counter() - t0},
    }
    where = f"trained WordPiece (kept in {shared})"
    if (shared / "tokenizer.json").is_file() and not force:
        record["reused"] = True
        return load_tokenizer(str(shared), data.max_seq_length), where, record
    t1 = time.perf_counter()
    characters = distinct_characters(sample_texts(table, ids))
    t2 = time.perf_counter()
    tokenizer = train_wordpiece(
        lambda: (text for a in sample_texts(table, ids) for text in a.to_pylist()),
        data.vocab_size,
        data.lowercase,
        length=int(ids.size),
        characters=characters,
    )
    allocator.release_free_memory()  # the trainer's word counts: not into the pairing workers
    record["seconds"].update({"alphabet": t2 - t1, "train": time.perf_counter() - t2})
    record["cpu_seconds"] = time.process_time() - cpu0  # of this process: the stage's work, load aside
    _publish_tokenizer(tokenizer, shared)
    return tokenizer, where, record
