"""Tokenize-only, the benchmarks' baseline for prepare: a corpus's files cut into prepare's documents and
batch-encoded with the same tokenizer, in the process that called :func:`init_worker` or in workers
forked from it (``bench/prepare.py``, ``bench/prepare_scale.py``)."""

from __future__ import annotations

import time
from pathlib import Path

_ENCODER = None
_ASCII_ENCODER = None


def init_worker(tokenizer_path: str, plain_ascii_fast: bool = False) -> None:
    """The tokenizer of this process; ``plain_ascii_fast``: also prepare's faster copy for plain-ASCII
    documents (``bert_mp.data.tokenizer.plain_ascii_encoder``), where the tokenizer has one."""
    global _ENCODER, _ASCII_ENCODER
    from transformers import AutoTokenizer

    from bert_mp.data.tokenizer import encoder, plain_ascii_encoder

    _ENCODER = encoder(AutoTokenizer.from_pretrained(tokenizer_path))
    _ASCII_ENCODER = plain_ascii_encoder(_ENCODER) if plain_ascii_fast else None


def encode_file(path: str, whole_file: bool = False) -> tuple[int, float]:
    """Tokens of one file and the CPU seconds it took (this worker's process time).

    The file's documents as prepare reads them: the text between blank lines, or (``whole_file``,
    data.documents=file) the whole file as one input; the plain-ASCII ones by the faster encoder
    where :func:`init_worker` made one, as prepare encodes them.
    """
    from bert_mp.data.whitespace import BLANK_LINES_RE

    c0 = time.process_time()
    text = Path(path).read_text(encoding="utf-8")
    docs = [text] if whole_file else [d for d in BLANK_LINES_RE.split(text) if d.strip()]
    groups = [(_ENCODER, docs)]
    if _ASCII_ENCODER is not None:
        import pyarrow as pa

        from bert_mp.data.arrow_text import plain_ascii

        plain = plain_ascii(pa.array(docs, pa.string())).tolist()
        groups = [
            (_ASCII_ENCODER, [d for d, p in zip(docs, plain, strict=True) if p]),
            (_ENCODER, [d for d, p in zip(docs, plain, strict=True) if not p]),
        ]
    tokens = 0
    for enc, part in groups:
        for lo in range(0, len(part), 256):
            encodings = enc.encode_batch_fast(part[lo : lo + 256], add_special_tokens=False)
            tokens += sum(len(e.ids) for e in encodings)
    return tokens, time.process_time() - c0
