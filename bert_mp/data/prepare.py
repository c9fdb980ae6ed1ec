"""``bert-mp prepare``: raw text -> NSP + MLM pretraining data, cached by the data-config hash.

Stages: read the corpus into an Arrow-backed ``Dataset`` (a generator, so memory stays bounded);
assign documents to train/validation by a hash of (seed, document index); train or load the
tokenizer; then each *block* of documents, in this process or in a pool of ``num_proc`` workers,
has its sentences split, every document of the block tokenized (256 per ``encode_batch_fast``
call), its documents paired (random B from another document of the block) and, in static mode,
its examples masked. A block is a fixed set of documents keyed by
global index and all randomness derives from (seed, split, dupe, block index), so the rows are
byte-identical for any ``num_proc``. The result is built in a temporary folder and renamed into
``<cache_dir>/<cache_key>/`` with a ``COMPLETE`` marker written last; a crash never leaves a cache
that would be reused.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import random
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bert_mp.core import console
from bert_mp.core.config import Config, DataConfig, load_config, save_config
from bert_mp.core.hold import hold
from bert_mp.core.io import atomic_write_json
from bert_mp.core.loop import interrupts_in_this_process_only
from bert_mp.data import allocator
from bert_mp.data.corpus import (
    ReadStats,
    describe_source,
    is_file_source,
    iter_documents,
    merge_read_stats,
    resolve_paths,
)
from bert_mp.data.fingerprint import folder_fingerprint
from bert_mp.data.masking import STREAM_MASKING, MaskingSpec, derive_rng, mask_sequence
from bert_mp.data.packing import pack_documents
from bert_mp.data.pairs import NspBalance, PairParams, PairStats, block_pairs, build_examples
from bert_mp.data.segment import (
    build_marker,
    count_markers,
    flatten_ids,
    mark_documents,
    mark_lines,
    marked_pieces,
    split_marked_tokens,
)
from bert_mp.data.tokenizer import (
    count_special_token_texts,
    encoder,
    inline_markers,
    load_tokenizer,
    round_vocab_size,
    save_tokenizer,
    special_token_texts,
    train_wordpiece,
)
from bert_mp.errors import DataError, Interrupted

SPLITS = ("train", "validation")
_STREAM_SPLIT = 3
_STATIC_MASK_EPOCH = 0


@dataclass
class PreparedData:
    """A prepared data folder, loaded."""

    dataset: Any
    """``datasets.DatasetDict`` with ``train`` and ``validation``."""
    tokenizer: Any
    stats: dict
    path: Path


def cache_path(data: DataConfig) -> Path:
    """Where the data for this config lives: ``<cache_dir>/<cache_key>``."""
    return Path(data.cache_dir) / data.cache_key()


def is_complete(path: Path) -> bool:
    return (Path(path) / "COMPLETE").is_file()


def load_prepared(path: str | Path) -> PreparedData:
    """Load a folder written by :func:`prepare`; refuses a partial one."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise DataError(f"no prepared data at {path}; run `bert-mp prepare` first")
    if not is_complete(path):
        raise DataError(f"{path} is incomplete (no COMPLETE marker); rerun `bert-mp prepare --force`")
    stats = json.loads((path / "stats.json").read_text(encoding="utf-8"))
    return PreparedData(
        dataset=load_from_disk(str(path / "dataset")),
        tokenizer=AutoTokenizer.from_pretrained(str(path / "tokenizer")),
        stats=stats,
        path=path,
    )


def _hash_uniform(seed: int, stream: int, index: np.ndarray) -> np.ndarray:
    """Uniform [0, 1) per index from a counter-based hash (splitmix64): no state, any order."""

    def mix(z: np.ndarray) -> np.ndarray:
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    with np.errstate(over="ignore"):
        base = mix(np.array([(seed % 2**64) ^ (stream << 56)], dtype=np.uint64))
        z = mix(index.astype(np.uint64) + base)
    return (z >> np.uint64(11)).astype(np.float64) / float(2**53)


def assign_splits(n_docs: int, fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of validation documents: a hash of (seed, index) below ``fraction``.

    With ``fraction > 0`` and at least two documents, each split gets at least one document.
    """
    u = _hash_uniform(seed, _STREAM_SPLIT, np.arange(n_docs))
    val = u < fraction
    if fraction > 0 and n_docs >= 2:
        if not val.any():
            val[np.argmin(u)] = True
        if val.all():
            val[np.argmax(u)] = False
    return val


def make_blocks(doc_ids: np.ndarray, chars: np.ndarray, block_chars: int) -> list[np.ndarray]:
    """Consecutive documents grouped into blocks of about ``block_chars`` characters, of equal size.

    The split's characters are shared out over ``round(total / block_chars)`` blocks (at least
    one): each block takes documents until it holds ``total // blocks`` characters, so the blocks
    come out equal but for a document's length, which evens out the workers' shares (a greedy cut
    at ``block_chars`` left a last block up to 1.5 times the others). A short tail, or one of a
    single document (no other document for a random B), joins the previous block.
    """
    if len(doc_ids) == 0:
        return []
    total = int(chars.sum())
    target = max(1, total // max(1, round(total / block_chars)))
    ends = []
    run = 0
    for i, c in enumerate(chars.tolist()):
        run += c
        if run >= target:
            ends.append(i + 1)
            run = 0
    if not ends or ends[-1] != len(doc_ids):
        if ends and (run < target // 2 or len(doc_ids) - ends[-1] == 1):
            ends[-1] = len(doc_ids)
        else:
            ends.append(len(doc_ids))
    starts = [0, *ends[:-1]]
    return [doc_ids[s:e] for s, e in zip(starts, ends)]


def _pairing_rng_key(seed: int, split: int, dupe: int, block: int) -> int:
    """The seed of a block's pairing generator, ``random.Random(key)``: one integer from all the
    keys (Random(int) seeds from every bit, identically on every run). Blocks are fixed by document
    index, so the pairs do not depend on ``num_proc``; one generator per block rather than per
    document (4 us of seeding each: 5% of prepare on corpora of ~150-character paragraphs)."""
    return (((seed % 2**64) << 16 | split) << 32 | dupe) << 64 | block


def take_column(table: pa.Table, ids: Any) -> pa.ChunkedArray:
    """``table["text"]`` at the (ascending, clustered) row ``ids``, as Arrow strings.

    The rows are taken from a zero-copy slice spanning ``min(ids)..max(ids)``: ``Table.take`` on
    the whole memory-mapped column concatenates every chunk first, which copies the corpus on each
    call and fails with an offset overflow once the text passes 2 GiB (seen on a 5 GB corpus).
    """
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size == 0:
        return pa.chunked_array([], pa.string())
    lo = int(ids.min())
    window = table.slice(lo, int(ids.max()) - lo + 1)
    return window.take(pa.array(ids - lo)).column("text")


def take_texts(table: pa.Table, ids: Any) -> list[str]:
    """``table["text"]`` at the row ``ids``, as Python strings (:func:`take_column`)."""
    return take_column(table, ids).to_pylist()


def _empty_table(static: bool, nsp: bool = True) -> pa.Table:
    cols = {
        "input_ids": pa.array([], pa.list_(pa.int32())),
        "token_type_ids": pa.array([], pa.list_(pa.int8())),
    }
    if nsp:
        cols["next_sentence_label"] = pa.array([], pa.int64())
    if static:
        cols["labels"] = pa.array([], pa.list_(pa.int32()))
    return pa.table(cols)


@dataclass
class Tokens:
    """The token ids of a block's documents, or of a run of them: ``flat`` holds every document's
    ids in order (``doc_lens`` each); with ``objective=nsp`` a marker id follows each sentence,
    ``marker_ids`` giving each document's."""

    flat: np.ndarray
    doc_lens: np.ndarray
    marker_ids: np.ndarray | None

    @staticmethod
    def join(parts: list[tuple[Tokens, dict]]) -> tuple[Tokens, dict]:
        """Consecutive runs of a block's documents as one, their statistics summed."""
        toks = [t for t, _ in parts]
        marker_ids = None if toks[0].marker_ids is None else np.concatenate([t.marker_ids for t in toks])
        tok = Tokens(
            np.concatenate([t.flat for t in toks]), np.concatenate([t.doc_lens for t in toks]), marker_ids
        )
        return tok, _sum_block_stats([st for _, st in parts])


_ENCODE_BATCH = 256
"""Documents per ``encode_batch_fast`` call: a whole block in one call is 10-20% slower (every
Encoding of the block alive at once) than a few hundred at a time."""


class _BlockPairer:
    """One block of documents in, its examples (an Arrow table) and its statistics out."""

    def __init__(self, docs: Any, tokenizer: Any, data: DataConfig):
        self.docs = docs
        self.encoder = encoder(tokenizer)
        self.cls_id, self.sep_id = int(tokenizer.cls_token_id), int(tokenizer.sep_token_id)
        self.splitter = data.sentence_splitter
        self.lines = data.documents == "line"
        self.mark = mark_lines if self.lines else build_marker(data.sentence_splitter)
        self.sep_token = tokenizer.sep_token
        self.specials = special_token_texts(self.encoder)
        self.inline = inline_markers(tokenizer, self.encoder)
        # the marker id of each choice (_choose_markers): the inline markers', then [SEP]'s
        self.marker_id_of = np.array([m for _, m in self.inline] + [self.sep_id], dtype=np.int32)
        self.nsp = data.objective == "nsp"
        self.max_seq_length = data.max_seq_length
        self.params = PairParams(data.max_seq_length - 3, data.short_seq_prob, data.nsp_random_prob)
        self.spec = MaskingSpec.from_tokenizer(tokenizer, data) if data.masking == "static" else None
        self.seed, self.dupe_factor = data.seed, data.dupe_factor
        self.schema = _empty_table(self.spec is not None, self.nsp).schema
        self.tokenize_stage = "mark_and_tokenize" if self.nsp else "tokenize"

    def __setstate__(self, state: dict) -> None:  # a pairer sent to a spawned worker
        self.__dict__.update(state)
        self.encoder.encode_special_tokens = True  # not part of a pickled Tokenizer

    def _encode(self, texts: list[str]) -> list[list[int]]:
        enc = self.encoder.encode_batch_fast
        out: list[list[int]] = []
        for lo in range(0, len(texts), _ENCODE_BATCH):
            out.extend([e.ids for e in enc(texts[lo : lo + _ENCODE_BATCH], add_special_tokens=False)])
        return out

    def _mark(self, texts: list[str], marker: str) -> tuple[list[str], list[int]]:
        if self.lines or self.splitter == "rule":  # one pass over the whole block
            return mark_documents(texts, marker, lines=self.lines)
        if not texts:
            return [], []
        marked, counts = zip(*(self.mark(t, marker) for t in texts), strict=True)
        return list(marked), list(counts)

    def _sentence_tokens(
        self, texts: list[str], st: dict
    ) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
        """Token ids of every document with a marker id after each sentence (``(flat, doc_lens)``
        of :func:`~bert_mp.data.segment.flatten_ids`), and each document's marker id.

        Sentence boundaries become marker tokens: the first inline punctuation marker that the
        document does not contain, where the tokenizer allows one; otherwise the document takes the
        [SEP] form (:meth:`_sep_form`).
        """
        sep_kind = len(self.inline)
        choice = self._choose_markers(texts)
        marker_ids = self.marker_id_of[choice]
        redo = choice == sep_kind
        if redo.all():
            flat, doc_lens = flatten_ids(self._sep_form(texts))
        else:
            marked, counts = self._mark_inline(texts, choice)
            flat, doc_lens = flatten_ids(self._encode(marked))
            del marked
            # Every inline marker must come back as exactly one marker id; a document where the
            # count differs (a normalizer that makes or eats the character) takes the [SEP] form.
            redo |= count_markers(flat, doc_lens, marker_ids) != counts
            if redo.any():
                ids = np.split(flat, np.cumsum(doc_lens)[:-1])
                idx = np.flatnonzero(redo).tolist()
                for i, x in zip(idx, self._sep_form([texts[i] for i in idx]), strict=True):
                    ids[i] = np.asarray(x, dtype=np.int32)
                doc_lens = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
                flat = np.concatenate(ids)
        marker_ids[redo] = self.sep_id
        st["sep_marked_documents"] = int(redo.sum())
        return (flat, doc_lens), marker_ids

    def _mark_inline(self, texts: list[str], choice: np.ndarray) -> tuple[list[str], np.ndarray]:
        """Each document marked with its inline marker (``choice``), and its marker count; "" and 0
        for the documents that take the [SEP] form."""
        n, sep_kind = len(texts), len(self.inline)
        kinds = np.unique(choice).tolist()
        if kinds == [0]:  # most blocks: every document takes the first marker
            marked, counts = self._mark(texts, self.inline[0][0])
            return marked, np.asarray(counts, dtype=np.int64)
        marked, counts = [""] * n, np.zeros(n, dtype=np.int64)
        for k in kinds:
            if k == sep_kind:
                continue
            idx = np.flatnonzero(choice == k).tolist()
            mk, ct = self._mark([texts[i] for i in idx], self.inline[k][0])
            for i, a in zip(idx, mk, strict=True):
                marked[i] = a
            counts[idx] = ct
        return marked, counts

    def _sep_form(self, texts: list[str]) -> list[list[int]]:
        """Each document's ids with [SEP]'s id after every sentence, as if each sentence were
        encoded alone. A document that holds no special token's text is marked with the [SEP]
        token and encoded whole, the tokenizer finding the [SEP]s (one input per document); one
        that holds some (a ``[SEP]`` or ``[MASK]`` written in the corpus) is cut into its sentences
        here and each is encoded alone, so that text stays text."""
        plain = [not any(s in t for s in self.specials) for t in texts]
        out: list[list[int]] = [[] for _ in texts]
        idx = [i for i, p in enumerate(plain) if p]
        if idx:
            marked, _ = self._mark([texts[i] for i in idx], self.sep_token)
            self.encoder.encode_special_tokens = False  # find the [SEP]s just marked
            try:
                for i, ids in zip(idx, self._encode(marked), strict=True):
                    out[i] = ids
            finally:
                self.encoder.encode_special_tokens = True
        for i in (i for i, p in enumerate(plain) if not p):
            flat, lens = flatten_ids(self._encode(marked_pieces(texts[i], self.mark)))
            out[i] = np.insert(flat, np.cumsum(lens), self.sep_id).tolist()
        return out

    def _choose_markers(self, texts: list[str]) -> np.ndarray:
        """Each document's marker: an index into ``self.inline``, ``len(self.inline)`` for [SEP]."""
        choice = np.zeros(len(texts), dtype=np.int64)
        if not self.inline:
            return choice
        first = self.inline[0][0]
        for i in [i for i, t in enumerate(texts) if first in t]:  # few: most take the first
            t = texts[i]
            choice[i] = next((k for k, (c, _) in enumerate(self.inline) if c not in t), len(self.inline))
        return choice

    def tokens(self, split: int, block: int, doc_ids: np.ndarray) -> tuple[Tokens, dict]:
        """The encoding half of a block (or of a part of one: documents are encoded independently,
        so parts concatenated in order are the whole block's :class:`Tokens`), and its statistics."""
        st: dict[str, Any] = {}
        t0 = time.process_time()  # CPU time of this worker, per stage
        column = take_column(self.docs.data.table, doc_ids)
        texts = column.to_pylist()
        t1 = time.process_time()
        # special tokens written in the text, tokenized as text (tokenizer.encoder), counted
        st["special_tokens_in_text"] = count_special_token_texts(column, self.specials)
        del column
        if self.nsp:
            (flat, doc_lens), marker_ids = self._sentence_tokens(texts, st)
        else:
            (flat, doc_lens), marker_ids = flatten_ids(self._encode(texts)), None
        st["seconds"] = {"read": t1 - t0, self.tokenize_stage: time.process_time() - t1}
        return Tokens(flat, doc_lens, marker_ids), st

    def _pairs(self, tok: Tokens, split: int, block: int, st: dict):
        """NSP examples of the block: ``(input_ids, token_type_ids, offsets, labels)`` or None."""
        n_docs = len(tok.doc_lens)
        flat, sent_lens, doc_of_sent, empty, cut = split_marked_tokens(
            (tok.flat, tok.doc_lens), tok.marker_ids, self.params.max_num_tokens
        )
        sents_per_doc = np.bincount(doc_of_sent, minlength=n_docs)
        kept_docs = np.flatnonzero(sents_per_doc)
        sent_bounds = [0, *np.cumsum(sent_lens).tolist()]
        doc_sents = [0, *np.cumsum(sents_per_doc[kept_docs]).tolist()]
        st.update(
            sentences=len(sent_lens),
            sentences_without_tokens=empty,
            sentences_cut_to_max_length=cut,
            documents_without_tokens=n_docs - len(kept_docs),
            single_sentence_documents=int((sents_per_doc[kept_docs] == 1).sum()),
            tokens=int(flat.size),
        )
        pstats = PairStats()
        balance = NspBalance(self.params.nsp_random_prob)
        pairs: list[tuple[int, int, int, int, int]] = []
        for dupe in range(self.dupe_factor):
            rng = random.Random(_pairing_rng_key(self.seed, split, dupe, block))
            pairs.extend(
                block_pairs(range(len(kept_docs)), sent_bounds, doc_sents, self.params, rng, balance, pstats)
            )
        st.update(asdict(pstats))
        if not pairs:
            return None
        return build_examples(flat, pairs, self.cls_id, self.sep_id)

    def _packed(self, tok: Tokens, st: dict):
        """MLM-only examples of the block (:mod:`bert_mp.data.packing`), or None."""
        flat, lengths = tok.flat, tok.doc_lens
        kept = lengths[lengths > 0]
        input_ids, offsets = pack_documents(flat, kept, self.max_seq_length, self.cls_id, self.sep_id)
        st.update(
            documents_without_tokens=len(lengths) - len(kept),
            tokens=int(flat.size),
            document_separators=max(0, len(kept) - 1),
        )
        if len(offsets) == 1:
            return None
        return input_ids, np.zeros(len(input_ids), dtype=np.int8), offsets, None

    def __call__(
        self, split: int, block: int, doc_ids: np.ndarray, parts: list[tuple[Tokens, dict]] | None = None
    ) -> tuple[pa.Table, dict]:
        """The block's examples and statistics; ``parts``: its :meth:`tokens`, already encoded in
        pieces (by other workers), in document order."""
        tok, st = Tokens.join(parts) if parts else self.tokens(split, block, doc_ids)
        st["documents"] = len(doc_ids)
        times = [time.process_time()]
        if self.nsp:
            examples = self._pairs(tok, split, block, st)
        else:
            examples = self._packed(tok, st)
        del tok
        times.append(time.process_time())
        if examples is None:
            table = _empty_table(self.spec is not None, self.nsp)
        else:
            input_ids, token_type_ids, offsets, labels = examples
            cols = {}
            if self.spec is not None:
                input_ids, mlm_labels = self._mask(input_ids, offsets, split, block, st)
                cols["labels"] = mlm_labels
            offsets = pa.array(offsets.astype(np.int32))
            cols = {k: pa.ListArray.from_arrays(offsets, pa.array(v)) for k, v in cols.items()}
            head = {
                "input_ids": pa.ListArray.from_arrays(offsets, pa.array(input_ids)),
                "token_type_ids": pa.ListArray.from_arrays(offsets, pa.array(token_type_ids)),
            }
            if labels is not None:
                head["next_sentence_label"] = pa.array(labels)
            table = pa.table({**head, **cols})
        times.append(time.process_time())
        st["examples"] = table.num_rows
        st["seconds"].update(
            {"pair" if self.nsp else "pack": times[1] - times[0], "build_and_mask": times[2] - times[1]}
        )
        return table, st

    def _mask(self, input_ids: np.ndarray, offsets: np.ndarray, split: int, block: int, st: dict):
        """Static masking, keyed by (seed, split, block, example within block)."""
        spec = self.spec
        masked = input_ids.copy()
        labels = np.full(input_ids.shape, -100, dtype=np.int32)
        for k in range(len(offsets) - 1):
            o0, o1 = int(offsets[k]), int(offsets[k + 1])
            rng = derive_rng(self.seed, STREAM_MASKING, _STATIC_MASK_EPOCH, split, block, k)
            masked[o0:o1], labels[o0:o1] = mask_sequence(input_ids[o0:o1], spec, rng)
        sel = labels != -100
        st["mask"] = {
            "candidates": int((~spec.special[input_ids]).sum()),
            "masked": int(sel.sum()),
            "as_mask_token": int((masked[sel] == spec.mask_token_id).sum()),
            "unchanged": int((masked[sel] == input_ids[sel]).sum()),
        }
        return masked, labels


@contextlib.contextmanager
def _arrow_stream(path: str | Path, schema: pa.Schema) -> Iterator[pa.ipc.RecordBatchStreamWriter]:
    """A writer of the Arrow stream file ``path`` (the format ``Dataset.from_file`` memory-maps)."""
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        yield writer


_READER_BYTES = 32 << 20
"""Bytes of files per reader process (``data.num_proc`` is the most)."""
_READ_BATCH_CHARS = 4 * 1024 * 1024
_TEXT_SCHEMA = pa.schema([("text", pa.string())])
_HASHED_SCHEMA = pa.schema([("text", pa.string()), ("hash_hi", pa.uint64()), ("hash_lo", pa.uint64())])


def _text_hashes(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """128-bit BLAKE2b of each document's stripped text, as two uint64 arrays (for data.dedupe)."""
    raw = b"".join(
        hashlib.blake2b(t.strip().encode("utf-8", "surrogatepass"), digest_size=16).digest() for t in texts
    )
    pairs = np.frombuffer(raw, dtype="<u8").reshape(-1, 2)
    return pairs[:, 0].copy(), pairs[:, 1].copy()


def first_occurrences(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """Sorted indices of the first occurrence of every distinct ``(hi, lo)`` pair."""
    if hi.size == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((np.arange(hi.size), lo, hi))  # by hash, then by position
    h, l_ = hi[order], lo[order]
    new = np.ones(hi.size, dtype=bool)
    new[1:] = (h[1:] != h[:-1]) | (l_[1:] != l_[:-1])
    return np.sort(order[new])


_docs_read: Any = None  # a shared counter of documents read, for the parent's progress bar


class _LocalCounter:
    """``mp.Value``'s interface (``value``, ``get_lock()``) for a counter used in one process."""

    value = 0

    def get_lock(self) -> contextlib.nullcontext:
        return contextlib.nullcontext()


def _init_reader(counter: Any) -> None:
    global _docs_read
    _docs_read = counter


def _read_job(data: DataConfig, paths: list[str] | None, out: str) -> ReadStats:
    """Documents of ``paths`` (``None``: the whole configured source) into the Arrow stream
    ``out``, a record batch per ~4 M characters: Arrow arrays built from lists of strings, with
    no per-document Python encoding step (``Dataset.from_generator`` encodes every example
    through ``Features``, which was half of the reading time)."""
    stats = ReadStats()
    batch: list[str] = []
    size = 0
    schema = _HASHED_SCHEMA if data.dedupe else _TEXT_SCHEMA
    with _arrow_stream(out, schema) as writer:

        def flush() -> None:
            cols = [pa.array(batch, pa.string())]
            if data.dedupe:
                cols += [pa.array(h) for h in _text_hashes(batch)]
            writer.write_batch(pa.record_batch(cols, schema=schema))
            if _docs_read is not None:
                with _docs_read.get_lock():
                    _docs_read.value += len(batch)
            batch.clear()

        for text in iter_documents(data, stats, None if paths is None else [Path(p) for p in paths]):
            batch.append(text)
            size += len(text)
            if size >= _READ_BATCH_CHARS:
                flush()
                size = 0
        if batch:
            flush()
    return stats


def _file_groups(paths: list[Path], jobs: int) -> list[list[str]]:
    """The file list cut into at most ``jobs`` contiguous runs of about equal bytes."""
    sizes = np.array([max(1, p.stat().st_size) for p in paths], dtype=np.float64)
    cuts = np.searchsorted(np.cumsum(sizes), sizes.sum() * np.arange(1, jobs) / jobs, side="left") + 1
    bounds = [0, *sorted(set(int(c) for c in cuts if 0 < c < len(paths))), len(paths)]
    return [[str(p) for p in paths[lo:hi]] for lo, hi in itertools.pairwise(bounds)]


def _read_documents(data: DataConfig, work: Path) -> tuple[Any, ReadStats]:
    """The corpus as a one-column (``text``) memory-mapped Arrow Dataset; counts in ReadStats.

    Files are read by up to ``num_proc`` processes, each a contiguous run of the file list into
    its own Arrow file, and the files are concatenated in order, so the documents and their
    indices are the same for any ``num_proc``. Memory stays bounded by a record batch per process.
    """
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    from datasets import Dataset, concatenate_datasets
    from tqdm.auto import tqdm

    out_dir = work / "documents"
    out_dir.mkdir(parents=True, exist_ok=True)
    groups: list[list[str] | None] = [None]
    resolved = ReadStats()  # files reached twice, counted while resolving the paths
    if is_file_source(data):
        paths = resolve_paths(data.paths, resolved)
        jobs = 1
        # max_documents counts across all files: one reader then; a reader process pays for itself
        # only on tens of megabytes (one reads ~200 MB/s; starting one takes ~0.1 s)
        if data.num_proc > 1 and data.max_documents is None:
            size = sum(p.stat().st_size for p in paths)
            jobs = min(data.num_proc, len(paths), max(1, size // _READER_BYTES))
        groups = _file_groups(paths, jobs) if jobs > 1 else [[str(p) for p in paths]]
    outs = [str(out_dir / f"part-{i:05d}.arrow") for i in range(len(groups))]
    # a shared counter only where other processes read (a lock-free one otherwise: no import of
    # multiprocessing's synchronisation machinery, a tenth of a second, for one reader)
    counter = mp.Value("q", 0) if len(groups) > 1 else _LocalCounter()
    with tqdm(desc="reading documents", unit=" docs", dynamic_ncols=True) as bar:
        if len(groups) == 1:
            _init_reader(counter)
            try:
                parts = [_read_job(data, groups[0], outs[0])]
            finally:
                _init_reader(None)
            bar.update(counter.value)
        else:
            with ProcessPoolExecutor(len(groups), initializer=_init_reader, initargs=(counter,)) as pool:
                futures = [pool.submit(_read_job, data, g, o) for g, o in zip(groups, outs, strict=True)]
                try:
                    while not all(f.done() for f in futures):
                        time.sleep(0.1)
                        bar.update(counter.value - bar.n)
                except BaseException:  # an interruption: end the readers now, not when they finish
                    _stop_pool(pool)
                    raise
                try:
                    parts = [f.result() for f in futures]  # the first failing run (in file order) raises
                except BrokenProcessPool:
                    raise DataError(
                        f"a reader process ended abruptly (killed, e.g. by the out-of-memory killer) while "
                        f"reading {describe_source(data)} with data.num_proc={data.num_proc}; "
                        "data.num_proc=1 reads in this process"
                    ) from None
            bar.update(counter.value - bar.n)
    stats = merge_read_stats([resolved, *parts])
    if stats.documents_kept == 0:
        detail = f"{stats.documents_read} read, {stats.dropped_empty} empty"
        if stats.binary_files:
            detail += f", {stats.binary_files} binary files skipped (first: {stats.first_binary_file})"
        if stats.records_without_text:
            detail += f", {stats.records_without_text} without a string {data.text_column!r} ({stats.first_problem})"
        raise DataError(f"no usable documents in {describe_source(data)} ({detail})")
    docs = [Dataset.from_file(o) for o in outs]
    return (docs[0] if len(docs) == 1 else concatenate_datasets(docs)), stats


def _stop_pool(pool: Any) -> None:
    """Cancel a ProcessPoolExecutor's queued jobs and terminate its workers (Python 3.14 has
    ``terminate_workers``; before, the workers are reached through ``_processes``)."""
    if hasattr(pool, "terminate_workers"):
        pool.terminate_workers()
        return
    workers = list((getattr(pool, "_processes", None) or {}).values())  # shutdown() forgets them
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in workers:
        proc.terminate()


def _length_summary(column: Any, max_len: int) -> tuple[int, int, dict[str, int]]:
    """``(examples, tokens, histogram)`` of the example lengths, one Arrow chunk at a time (the
    column is memory-mapped; a whole-split length array would grow with the corpus)."""
    width = max(1, max_len // 8)
    counts = np.zeros(max_len // width + 1, dtype=np.int64)
    n = total = 0
    for chunk in column.chunks:
        lengths = pc.list_value_length(chunk).to_numpy(zero_copy_only=False).astype(np.int64)
        counts += np.bincount(np.minimum(lengths, max_len) // width, minlength=counts.size)
        n += lengths.size
        total += int(lengths.sum())
    hist = {f"{i * width}-{min(max_len, (i + 1) * width - 1)}": int(c) for i, c in enumerate(counts) if c}
    return n, total, hist


def _sum_block_stats(blocks: list[dict]) -> dict:
    total: dict[str, Any] = {}

    def add(dst: dict, src: dict) -> None:
        for k, v in src.items():
            if isinstance(v, dict):
                add(dst.setdefault(k, {}), v)
            else:
                dst[k] = dst.get(k, 0) + v

    for st in blocks:
        add(total, st)
    return total


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
    documents are the same bytes shares it, and no other does. (WordPiece training itself is not
    reproducible run to run - huggingface/tokenizers#1794 - so reuse keeps vocabularies equal.)"""
    inputs = {"text": text_digest, "vocab_size": data.vocab_size, "lowercase": data.lowercase}
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    return Path(data.cache_dir) / "tokenizers" / key


def _publish_tokenizer(tokenizer: Any, path: Path) -> None:
    tmp = path.parent / f".tmp-{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        save_tokenizer(tokenizer, tmp)
        hold("tokenizer", "written")  # tests only: stop here until signalled
        if path.exists():
            old = path.parent / f".old-{path.name}-{uuid.uuid4().hex[:8]}"
            path.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(path)
    except BaseException:  # an error or a Ctrl-C: no half-written tokenizer stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove_own_tokenizer_tmp(data: DataConfig) -> None:
    """A SIGTERM exits at once, without unwinding: remove this process's temporary tokenizer folder."""
    for tmp in (Path(data.cache_dir) / "tokenizers").glob(f".tmp-*-{os.getpid()}-*"):
        shutil.rmtree(tmp, ignore_errors=True)


_PAIR_WORKER: tuple | None = None
"""``(pairer, blocks, out_dir)`` in a pairing worker process (:func:`_init_pair_worker`)."""


def _init_pair_worker(pairer: _BlockPairer, blocks: dict, out_dir: Path) -> None:
    global _PAIR_WORKER
    _PAIR_WORKER = (pairer, blocks, out_dir)


def _block_file(out_dir: Path, split: int, block: int) -> Path:
    return out_dir / f"{split}_{block:08d}.arrow"


def _pair_job(split: int, block: int, parts: list[tuple[Tokens, dict]] | None = None) -> dict:
    """One block in a worker: its examples to ``<out_dir>/<split>_<block>.arrow``; its statistics
    back. ``parts``: the block's tokens, encoded in pieces by :func:`_tokens_job`."""
    assert _PAIR_WORKER is not None, "a pairing job outside a pairing worker"
    pairer, blocks, out_dir = _PAIR_WORKER
    table, st = pairer(split, block, blocks[split][block], parts)
    path = _block_file(out_dir, split, block)
    with _arrow_stream(path, pairer.schema) as writer:
        writer.write_table(table)
    return st


def _tokens_job(split: int, block: int, doc_ids: np.ndarray) -> tuple[Tokens, dict]:
    """A run of a block's documents encoded in a worker: :meth:`_BlockPairer.tokens`, sent back."""
    assert _PAIR_WORKER is not None, "a tokens job outside a pairing worker"
    return _PAIR_WORKER[0].tokens(split, block, doc_ids)


_PIECES_PER_WORKER = 4
"""Work units per pairing worker below which blocks are encoded in pieces (:func:`_work_units`)."""


def _work_units(
    blocks: dict[int, list[np.ndarray]],
    keys: list[tuple[int, int]],
    costs: list[int],
    num_proc: int,
    chars: np.ndarray,
) -> list[tuple[int, tuple[int, int], int | None, np.ndarray | None]]:
    """The pool's jobs, longest first: ``(cost, key, piece, doc_ids)``.

    A block is one job (``piece`` None). On a small corpus of long documents the few blocks share
    out unevenly over the workers (13 MB in 2 MB blocks is 6-7 jobs for 2 workers), so a block
    over ``1 / (_PIECES_PER_WORKER * num_proc)`` of all characters is encoded in pieces of whole
    documents of about that size (``piece`` 0, 1, ...), each a job of its own; once all of a
    block's pieces are back, its pairing is a job. Documents are encoded independently, so the
    rows are the same either way. On a large corpus (many blocks per worker) nothing is cut.
    """
    target = max(1.0, sum(costs) / (_PIECES_PER_WORKER * num_proc))
    units = []
    for key, cost in zip(keys, costs, strict=True):
        doc_ids = blocks[key[0]][key[1]]
        n = min(len(doc_ids), math.ceil(cost / target))
        pieces = [doc_ids]
        if n > 1:  # (most blocks of a large corpus are not: no per-document work for them)
            run = np.cumsum(chars[doc_ids])
            cuts = np.unique(np.searchsorted(run, run[-1] * np.arange(1, n) / n) + 1)
            pieces = np.split(doc_ids, cuts[(cuts > 0) & (cuts < len(doc_ids))])
        if len(pieces) <= 1:  # small enough, one document, or one document holds nearly all of it
            units.append((cost, key, None, None))
            continue
        for j, ids in enumerate(pieces):
            units.append((int(chars[ids].sum()), key, j, ids))
    return sorted(units, key=lambda u: (-u[0], u[1], u[2] or 0))


def _pool_context() -> Any:
    """``fork`` where the platform has it (workers inherit the pairer and the memory-mapped
    documents, nothing is pickled); the platform's default (spawn) elsewhere."""
    import multiprocessing as mp

    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else None)


def _pair_blocks(
    pairer: _BlockPairer, blocks: dict[int, list[np.ndarray]], chars: np.ndarray, data: DataConfig, work: Path
) -> tuple[dict, dict[int, list[dict]]]:
    """Every block of both splits paired; returns the split datasets and each split's block statistics.

    With ``num_proc`` 1 the blocks run in this process, in (split, block) order, straight into one
    Arrow file per split. With more, a process pool takes the blocks longest first (cost =
    characters; where there are few blocks per worker, large ones are encoded in pieces first:
    :func:`_work_units`), each worker taking the next job as it finishes (so the workers end close
    together), and writes each block's examples to a file of its own; the files are then joined
    in (split, block) order. The rows are the same for any ``num_proc``.
    """
    from datasets import Dataset
    from tqdm.auto import tqdm

    keys = [(s, b) for s in range(len(SPLITS)) for b in range(len(blocks[s]))]
    num_proc = min(data.num_proc, len(keys))
    counts = " + ".join(f"{len(blocks[s])} {name}" for s, name in enumerate(SPLITS))
    stats: dict[tuple[int, int], dict] = {}
    out_dir = work / "blocks"
    out_dir.mkdir(parents=True, exist_ok=True)
    split_files = [work / f"examples-{name}.arrow" for name in SPLITS]
    with tqdm(total=len(keys), desc=f"pairing ({counts} blocks)", unit=" blocks", dynamic_ncols=True) as bar:
        if num_proc <= 1:
            for s, path in enumerate(split_files):
                with _arrow_stream(path, pairer.schema) as writer:
                    for b, doc_ids in enumerate(blocks[s]):
                        table, stats[s, b] = pairer(s, b, doc_ids)
                        writer.write_table(table)
                        bar.update(1)
                        hold("prepare", "paired")  # tests only: stop here until signalled
        else:
            costs = [int(chars[blocks[s][b]].sum()) for s, b in keys]
            _run_pair_pool(pairer, blocks, keys, costs, chars, num_proc, out_dir, stats, bar)
            for s, path in enumerate(split_files):
                _join_block_files(
                    [_block_file(out_dir, s, b) for b in range(len(blocks[s]))], path, pairer.schema
                )
    out, block_stats = {}, {}
    for s, name in enumerate(SPLITS):
        out[name] = Dataset.from_file(str(split_files[s]))
        block_stats[s] = [stats[s, b] for b in range(len(blocks[s]))]
        written = sum(st["examples"] for st in block_stats[s])
        if written != len(out[name]):
            raise RuntimeError(
                f"pairing wrote {len(out[name])} {name} rows but the block statistics count {written}"
            )
    return out, block_stats


def _run_pair_pool(pairer, blocks, keys, costs, chars, num_proc, out_dir, stats, bar) -> None:
    """The blocks ``keys`` through ``num_proc`` worker processes, longest first (:func:`_work_units`);
    statistics into ``stats``."""
    from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    units = _work_units(blocks, keys, costs, num_proc, chars)
    pieces: dict[tuple[int, int], list] = {}  # the encoded pieces of a cut block, as they come back
    for _, key, j, _ in units:
        if j is not None:
            pieces.setdefault(key, []).append(None)
    with ProcessPoolExecutor(
        num_proc,
        mp_context=_pool_context(),
        initializer=_init_pair_worker,
        initargs=(pairer, blocks, out_dir),
    ) as pool:
        futures = {
            pool.submit(_pair_job, *key) if j is None else pool.submit(_tokens_job, *key, ids): (key, j)
            for _, key, j, ids in units
        }
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, timeout=0.5, return_when=FIRST_EXCEPTION)
                for f in done:
                    key, j = futures.pop(f)
                    if j is None:
                        stats[key] = f.result()  # a worker's error is raised here
                        bar.update(1)
                        hold("prepare", "paired")  # tests only: stop here until signalled
                        continue
                    pieces[key][j] = f.result()
                    if all(p is not None for p in pieces[key]):  # the block's pairing, now a job
                        nxt = pool.submit(_pair_job, *key, pieces.pop(key))
                        futures[nxt] = (key, None)
                        pending.add(nxt)
        except BrokenProcessPool:
            _stop_pool(pool)
            raise DataError(
                "a pairing worker process ended abruptly (killed, e.g. by the out-of-memory killer); "
                f"with data.num_proc={num_proc} each worker holds one block of data.pairing_block_chars "
                "characters: lower data.num_proc or data.pairing_block_chars"
            ) from None
        except BaseException:  # an error or an interruption: end the workers now
            _stop_pool(pool)
            raise


def _join_block_files(files: list[Path], out: Path, schema: pa.Schema) -> None:
    """The block files' record batches, in order, into one Arrow stream file; each removed once copied."""
    with _arrow_stream(out, schema) as writer:
        for path in files:
            with pa.memory_map(str(path)) as src:
                for batch in pa.ipc.open_stream(src):
                    writer.write_batch(batch)
            path.unlink()


def _tokenizer_for(data: DataConfig, docs: Any, train_ids: np.ndarray, force: bool) -> tuple[Any, str]:
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
    tokenizer = train_wordpiece(train_texts(), data.vocab_size, data.lowercase, length=len(train_ids))
    _publish_tokenizer(tokenizer, shared)
    return tokenizer, where


def _build(cfg: Config, out: Path, force: bool = False) -> dict:
    """Build the whole prepared folder at ``out``; returns the stats."""
    from datasets import DatasetDict

    data = cfg.data
    work = out / "work"
    work.mkdir(parents=True)
    timings: dict[str, float] = {}
    t_start = time.perf_counter()

    t = time.perf_counter()
    docs, read_stats = _read_documents(data, work)
    timings["read"] = time.perf_counter() - t

    n_docs = len(docs)
    val_mask = assign_splits(n_docs, data.validation_fraction, data.seed)
    chars = pc.utf8_length(docs.data.table.column("text")).to_numpy(zero_copy_only=False).astype(np.int64)
    kept = np.ones(n_docs, dtype=bool)
    if data.dedupe:
        table = docs.data.table
        hi, lo = (table.column(c).to_numpy() for c in ("hash_hi", "hash_lo"))
        kept[:] = False
        kept[first_occurrences(hi, lo)] = True
        read_stats.duplicate_documents = int(n_docs - kept.sum())
        kept_ids = np.flatnonzero(kept)
        if (
            kept_ids.size >= 2
            and data.validation_fraction > 0
            and (val_mask[kept_ids].all() or not val_mask[kept_ids].any())
        ):
            # the duplicates took all of one split: split the kept documents among themselves
            val_mask[kept_ids] = assign_splits(kept_ids.size, data.validation_fraction, data.seed)
    split_docs = {0: np.flatnonzero(~val_mask & kept), 1: np.flatnonzero(val_mask & kept)}
    blocks = {s: make_blocks(ids, chars[ids], data.pairing_block_chars) for s, ids in split_docs.items()}

    t = time.perf_counter()
    tokenizer, tokenizer_from = _tokenizer_for(data, docs, split_docs[0], force)
    timings["tokenizer"] = time.perf_counter() - t

    t = time.perf_counter()
    pairer = _BlockPairer(docs, tokenizer, data)
    splits, block_stats = _pair_blocks(pairer, blocks, chars, data, work)
    timings["split_tokenize_pair"] = time.perf_counter() - t

    if len(splits["train"]) == 0 and data.objective == "mlm":
        raise DataError(
            f"{describe_source(data)} gave no training examples: no training document has a token"
        )
    if len(splits["train"]) == 0:
        raise DataError(
            f"{describe_source(data)} gave no training pairs: every document is a single sentence and there is no "
            "other document for a random B; add documents or use a multi-sentence corpus"
        )

    t = time.perf_counter()
    dd = DatasetDict(splits)
    num_shards = {name: max(1, min(data.num_shards, len(ds))) for name, ds in dd.items()}
    dd.save_to_disk(str(out / "dataset"), num_shards=num_shards)
    save_tokenizer(tokenizer, out / "tokenizer")
    timings["write"] = time.perf_counter() - t

    stats = _collect_stats(
        data, dd, tokenizer, tokenizer_from, read_stats, block_stats, timings, time.perf_counter() - t_start
    )
    shutil.rmtree(work, ignore_errors=True)
    return stats


def _nsp_stats(blk: dict, examples: int, random_next: int) -> dict:
    """The NSP label balance of a split, from its summed block statistics."""
    return {
        "random_next": random_next,
        "is_next": examples - random_next,
        "random_share": (random_next / examples) if examples else None,
        "forced_random": int(blk.get("forced_random", 0)),
        "no_other_document": int(blk.get("no_other_document", 0)),
        "skipped_single_segment": int(blk.get("skipped_single_segment", 0)),
    }


def _masking_stats(m: dict) -> dict:
    """Static masking's shares: of the candidates, and the 80/10/10 split of the masked."""
    sel = max(1, m["masked"])
    return {
        "masked": m["masked"],
        "masked_share_of_candidates": m["masked"] / max(1, m["candidates"]),
        "as_mask_token": m["as_mask_token"] / sel,
        "as_random_token": (m["masked"] - m["as_mask_token"] - m["unchanged"]) / sel,
        "unchanged": m["unchanged"] / sel,
    }


def _collect_stats(data, dd, tokenizer, tokenizer_from, read_stats, block_stats, timings, elapsed) -> dict:
    nsp = data.objective == "nsp"
    per_split = {}
    for s, name in enumerate(SPLITS):
        blk = _sum_block_stats(block_stats[s])
        ds = dd[name]
        examples, example_tokens, histogram = _length_summary(
            ds.data.table.column("input_ids"), data.max_seq_length
        )
        entry: dict[str, Any] = {
            "examples": examples,
            "blocks": len(block_stats[s]),
            "documents": int(blk.get("documents", 0)),
            "documents_without_tokens": int(blk.get("documents_without_tokens", 0)),
        }
        if nsp:
            random_next = int(blk.get("random_next", 0))
            entry.update(
                {
                    # documents marked with [SEP] rather than a faster inline marker (tokenizer.inline_markers)
                    "sep_marked_documents": int(blk.get("sep_marked_documents", 0)),
                    "single_sentence_documents": int(blk.get("single_sentence_documents", 0)),
                    "sentences": int(blk.get("sentences", 0)),
                    "sentences_without_tokens": int(blk.get("sentences_without_tokens", 0)),
                    "sentences_cut_to_max_length": int(blk.get("sentences_cut_to_max_length", 0)),
                }
            )
        entry["tokens"] = int(blk.get("tokens", 0))
        entry["example_tokens"] = example_tokens
        # special tokens' text (a [SEP] or [MASK] written in the corpus), tokenized as text
        entry["special_tokens_in_text"] = dict(sorted(blk.get("special_tokens_in_text", {}).items()))
        if nsp:
            entry["nsp"] = _nsp_stats(blk, examples, random_next)
            entry["truncated_tokens"] = int(blk.get("truncated_tokens", 0))
            # of the tokens that dupe_factor passes over the split's sentences hold
            passes = entry["tokens"] * data.dupe_factor
            entry["truncated_share"] = entry["truncated_tokens"] / passes if passes else None
        else:
            entry["nsp"] = None
            # [SEP] tokens put between consecutive documents of a block when packing
            entry["document_separators"] = int(blk.get("document_separators", 0))
        entry.update(
            {
                "length_histogram": histogram,
                "mean_length": example_tokens / examples if examples else None,
                "padding_fraction_at_max_seq_length": (
                    1.0 - example_tokens / (examples * data.max_seq_length) if examples else None
                ),
                "cpu_seconds": blk.get("seconds", {}),
            }
        )
        if "mask" in blk:
            entry["masking"] = _masking_stats(blk["mask"])
        per_split[name] = entry
    tokens = sum(v["tokens"] for v in per_split.values())
    return {
        "source": describe_source(data),
        "cache_key": data.cache_key(),
        "tokenizer": tokenizer_from,
        "tokenizer_size": len(tokenizer),
        "model_vocab_size": round_vocab_size(len(tokenizer)),
        "max_seq_length": data.max_seq_length,
        "dupe_factor": data.dupe_factor,
        "objective": data.objective,
        "documents_mode": data.documents,
        "masking": data.masking,
        "max_predictions_per_seq": data.max_predictions(),
        "documents": {**asdict(read_stats), "documents_kept": read_stats.documents_kept},
        "splits": {name: v["examples"] for name, v in per_split.items()},
        "nsp_random_share": per_split["train"]["nsp"]["random_share"] if nsp else None,
        "per_split": per_split,
        "tokens": tokens,
        "seconds": {**timings, "total": elapsed},
        "tokens_per_sec": tokens / elapsed if elapsed > 0 else None,
        "num_proc": data.num_proc,
    }


FEW_VALIDATION_DOCUMENTS = 10
"""A validation split of fewer documents is flagged: its NSP and MLM figures say little."""


def _nsp_share_off(split: dict, data: DataConfig) -> bool:
    """Whether the split's NSP random share is more than 0.05 off ``data.nsp_random_prob``."""
    share = split["nsp"]["random_share"] if split["nsp"] else None
    return share is not None and abs(share - data.nsp_random_prob) > 0.05 + 1e-9


def _nsp_share_warning(split: dict, name: str, data: DataConfig) -> str | None:
    """A warning when the split's NSP random share is off its target, with the reason and the fix."""
    if not _nsp_share_off(split, data):
        return None
    share, lo, hi = split["nsp"]["random_share"], data.nsp_random_prob - 0.05, data.nsp_random_prob + 0.05
    why = ""
    if split["nsp"]["no_other_document"] or split["nsp"]["skipped_single_segment"]:
        why = " (a block holds a single document, so a random B was impossible; add documents)"
    elif split["nsp"]["forced_random"] > 0.5 * split["examples"]:
        fix = "use longer documents"
        if data.source == "text" and data.documents == "blank_line":
            fix = "data.documents=file reads each file as one document, or use longer documents"
        why = f" (most chunks are single sentences, which force a random B; {fix})"
    return f"NSP random share {share:.3f} ({name}) is outside {max(0, lo):.2f}-{min(1, hi):.2f}{why}"


def _validation_warning(stats: dict, data: DataConfig) -> str | None:
    """A warning when a validation split was asked for but is too small to evaluate NSP or MLM."""
    val = stats["per_split"]["validation"]
    if data.validation_fraction == 0:
        return None
    problems = []
    if val["documents"] < FEW_VALIDATION_DOCUMENTS:
        problems.append(f"{val['documents']} document{'s' * (val['documents'] != 1)}")
    if val["examples"] == 0:
        problems.append("0 examples")
    if not problems:
        return _nsp_share_warning(val, "validation", data)
    if _nsp_share_off(val, data):
        problems.append(f"NSP random share {val['nsp']['random_share']:.3f}")
    return (
        f"the validation split is too small to evaluate {'NSP or ' if val['nsp'] else ''}MLM meaningfully "
        f"({', '.join(problems)}); raise data.validation_fraction (now {data.validation_fraction}, at most "
        "0.5) or add documents"
    )


def _warnings(stats: dict, data: DataConfig) -> list[str]:
    out = [
        w
        for w in (
            _nsp_share_warning(stats["per_split"]["train"], "train", data),
            _validation_warning(stats, data),
        )
        if w
    ]
    d = stats["documents"]
    if d["invalid_utf8_replaced"]:
        out.append(f"{d['invalid_utf8_replaced']} invalid UTF-8 sequences were replaced with U+FFFD")
    if d["records_without_text"] or d["invalid_json_lines"]:
        out.append(
            f"skipped {d['records_without_text']} records without text and {d['invalid_json_lines']} invalid JSON "
            f"lines; first: {d['first_problem']}"
        )
    if d["binary_files"]:
        out.append(f"skipped {d['binary_files']} files that look binary; first: {d['first_binary_file']}")
    if d["duplicate_paths"]:
        out.append(
            f"{d['duplicate_paths']} files were reached twice and read once; first: {d['first_duplicate_path']}"
        )
    cap = data.masking_cap_warning()
    if cap:
        out.append(cap)
    return out


def _truncation_line(stats: dict) -> str:
    """The summary's line on the tokens NSP pairs lost to fit ``max_seq_length``, with their share."""
    splits = stats["per_split"].values()
    cut, tokens = sum(v["truncated_tokens"] for v in splits), sum(v["tokens"] for v in splits)
    dupe = stats["dupe_factor"]
    share = cut / (tokens * dupe) if tokens else 0.0
    of = f"{dupe} passes (data.dupe_factor) over " if dupe > 1 else ""
    return (
        f"  truncated: {cut} tokens cut from pairs to fit max_seq_length {stats['max_seq_length']}, "
        f"{share:.1%} of {of}the corpus's {tokens} tokens"
    )


def print_summary(stats: dict, path: Path) -> None:
    """A short human summary of ``stats.json``."""
    d, train, val = stats["documents"], stats["per_split"]["train"], stats["per_split"]["validation"]
    dupes = f", {d['duplicate_documents']} duplicates removed" if d["duplicate_documents"] else ""
    sentences = f"sentences: {train['sentences'] + val['sentences']}, " if train["nsp"] is not None else ""
    lines = [
        f"prepared {stats['source']} -> {path}",
        f"  documents: {d['documents_read']} read, {d['documents_kept']} kept, {d['dropped_empty']} empty "
        f"dropped{dupes}, {train['documents']} train / {val['documents']} validation "
        f"(data.documents={stats['documents_mode']})",
        f"  {sentences}tokens: {stats['tokens']}, "
        f"tokenizer: {stats['tokenizer_size']} (model vocab {stats['model_vocab_size']})",
        f"  examples ({stats['objective']}): {train['examples']} train / {val['examples']} validation, "
        f"max_seq_length {stats['max_seq_length']}, mean length {train['mean_length'] or 0:.1f}, padding at "
        f"max length {(train['padding_fraction_at_max_seq_length'] or 0):.1%}",
    ]
    if train["nsp"] is not None:
        lines.append(
            f"  NSP random share (train): {train['nsp']['random_share'] or 0:.3f} "
            f"({train['nsp']['forced_random']} forced by one-segment chunks)"
        )
        lines.append(_truncation_line(stats))
    else:
        lines.append("  objective mlm: packed sequences, no NSP labels (the NSP loss is not trained)")
    written = _sum_block_stats([v["special_tokens_in_text"] for v in stats["per_split"].values()])
    if written:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(written.items()))
        lines.append(f"  special tokens written in the text (tokenized as text, not as specials): {counts}")
    if "masking" in train:
        m = train["masking"]
        lines.append(
            f"  static masking: {m['masked_share_of_candidates']:.3f} of tokens, "
            f"{m['as_mask_token']:.2f}/{m['as_random_token']:.2f}/{m['unchanged']:.2f} mask/random/kept"
        )
    sec = stats["seconds"]
    lines.append(
        "  seconds: "
        + ", ".join(f"{k} {v:.1f}" for k, v in sec.items())
        + f"; {stats['tokens_per_sec']:.0f} tokens/s"
    )
    lines += [f"  warning: {w}" for w in stats.get("warnings", [])]
    if console.is_main_process():
        print("\n".join(lines), flush=True)


def prepare(cfg: Config, force: bool = False) -> Path:
    """The prepared folder for ``cfg.data``, built unless a complete cached copy exists (or ``force``)."""
    data = cfg.data
    data.validate()
    final = cache_path(data)
    if is_complete(final) and not force:
        console.say(f"reusing {final} (same data config; --force rebuilds)", command="prepare")
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    was_complete = is_complete(final)

    def on_exit(signum: int) -> None:  # SIGTERM (or a second Ctrl-C): the process exits right after
        detail = _left_behind(final, tmp, was_complete)
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_own_tokenizer_tmp(data)
        if console.is_main_process():  # named for the command run (train, when it prepares first)
            print(Interrupted(signum, detail).line(console.command("prepare")), file=sys.stderr)

    try:
        with interrupts_in_this_process_only(on_exit) as caught:
            try:
                tmp.mkdir()
                with allocator.tuned():
                    stats = _build(cfg, tmp, force)
                stats["warnings"] = _warnings(stats, data)
                stats["fingerprint"] = folder_fingerprint(tmp)
                _say_if_rebuilt_differently(final, stats["fingerprint"])
                save_config(data_only(cfg), tmp / "config.yaml")
                atomic_write_json(tmp / "stats.json", stats)
                (tmp / "COMPLETE").write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()) + "\n")
                _publish(tmp, final)
            except BaseException as e:
                if caught.signum is None:
                    refused = _refused_write(e, final, tmp, was_complete)
                    if refused is None:
                        raise
                    raise refused from None
                # whatever unwinding the worker pools raised on the way (datasets chains a TimeoutError)
                raise Interrupted(caught.signum, _left_behind(final, tmp, was_complete)) from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    print_summary(stats, final)
    return final


def _refused_write(e: BaseException, final: Path, tmp: Path, was_complete: bool) -> BaseException | None:
    """A build the disk refused (full, read-only, I/O error) as one line, else None (re-raise ``e``)."""
    from bert_mp.core import storage

    if not isinstance(e, Exception) or storage.write_failure(e) is None:
        return None
    written, left = storage.human_bytes(storage.folder_bytes(tmp)), _left_behind(final, tmp, was_complete)
    storage.remove_quietly(tmp)  # before the free space is measured: it only held space
    return storage.storage_error(
        "the prepared data",
        final.parent,
        e,
        None,
        f"the build had written {written} when it stopped (it needs more); {left}. Free disk space "
        "(or set data.cache_dir to a larger disk) and run bert-mp prepare again",
    )


def _left_behind(final: Path, tmp: Path, was_complete: bool) -> str:
    """What an interrupted :func:`prepare` leaves at ``final`` (its temporary folder is removed)."""
    if not is_complete(final):
        if was_complete:  # the signal came between the two renames of _publish
            return f"{final} removed while its older copy was being replaced; run prepare again"
        return f"nothing written to {final}"
    return f"{final} kept as it was" if tmp.exists() else f"{final} was complete before the signal"


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` folder to ``final``, replacing an older copy."""
    if final.exists():
        old = final.parent / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
        final.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    tmp.rename(final)


def _say_if_rebuilt_differently(final: Path, fingerprint: str) -> None:
    """``--force`` over a folder whose bytes change: runs trained on it must hear of it."""
    old_stats = final / "stats.json"
    if not old_stats.is_file():
        return
    old = json.loads(old_stats.read_text(encoding="utf-8")).get("fingerprint")
    if old and old != fingerprint:
        console.say(
            f"warning: rebuilt {final} with other bytes (fingerprint {old} -> {fingerprint}); "
            "runs trained on the old data refuse to resume on it unless train.allow_data_change=true",
            command="prepare",
        )


def data_only(cfg: Config) -> Config:
    """The config with only the data section from ``cfg`` (the rest at defaults): what the folder depends on."""
    return Config(data=cfg.data)


def command(config_path: str | None, overrides: list[str], force: bool = False) -> int:
    """``bert-mp prepare [CONFIG] [key=value ...] [--force]``."""
    cfg = load_config(config_path, overrides)
    prepare(cfg, force=force)
    return 0
