"""The tokenizer of a prepared folder: ``data.tokenizer`` loaded, or a WordPiece tokenizer trained on the
training documents and kept under ``<cache_dir>/tokenizers/`` keyed by its training text.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from bert_mp.core.config import DataConfig
from bert_mp.core.run.hold import hold
from bert_mp.core.storage.disk import write_folder_atomically
from bert_mp.data.prepare.blocks import take_texts
from bert_mp.data.tokenizer import load_tokenizer, save_tokenizer, train_wordpiece


def training_text_digest(table: pa.Table, train_ids: np.ndarray) -> str:
    """sha256 of what WordPiece training reads: the text and length of every document in corpus
    order (the ``text`` column's Arrow buffers, hashed as they are: no Python work per document,
    ~2 GB/s) and which of them are training documents (``train_ids``)."""
    text, lengths = hashlib.sha256(), []
    for chunk in (c for c in table.column("text").chunks if len(c)):
        kind = np.int64 if pa.types.is_large_string(chunk.type) else np.int32
        offsets = np.frombuffer(chunk.buffers()[1], dtype=kind)[chunk.offset : chunk.offset + len(chunk) + 1]
        text.update(memoryview(chunk.buffers()[2])[int(offsets[0]) : int(offsets[-1])])
        lengths.append(np.diff(offsets).astype("<i8"))
    parts = {
        "text": text.hexdigest(),
        "lengths": hashlib.sha256(np.concatenate([np.zeros(0, "<i8"), *lengths]).tobytes()).hexdigest(),
        "train": hashlib.sha256(np.asarray(train_ids, dtype="<i8").tobytes()).hexdigest(),
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


def tokenizer_for(data: DataConfig, docs: Any, train_ids: np.ndarray, force: bool) -> tuple[Any, str]:
    """``data.tokenizer`` loaded, or a WordPiece tokenizer trained on the training documents (kept
    and reused by every data config with the same training text: :func:`tokenizer_cache_path`);
    and where it came from, for ``stats.json``."""
    if data.tokenizer:
        return load_tokenizer(data.tokenizer, data.max_seq_length), data.tokenizer

    def train_texts():
        for lo in range(0, len(train_ids), 1000):
            yield from take_texts(docs.data.table, train_ids[lo : lo + 1000])

    shared = tokenizer_cache_path(data, training_text_digest(docs.data.table, train_ids))
    where = f"trained WordPiece (kept in {shared})"
    if (shared / "tokenizer.json").is_file() and not force:
        return load_tokenizer(str(shared), data.max_seq_length), where
    tokenizer = train_wordpiece(train_texts, data.vocab_size, data.lowercase, length=len(train_ids))
    _publish_tokenizer(tokenizer, shared)
    return tokenizer, where
