"""Splits, blocks and pairing: documents to train/validation by a hash of their index, each split cut
into blocks of about ``data.pairing_block_chars`` characters, and a block turned into its examples
(:class:`BlockPairer`: sentences marked and tokenized, NSP pairs or packed sequences, static masking).
All randomness derives from (seed, split, dupe, block index), so a block's rows never depend on
which process built it.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from bert_mp.core.config import DataConfig
from bert_mp.data.arrow_text import plain_ascii
from bert_mp.data.masking import STREAM_MASKING, MaskingSpec, derive_rng, mask_sequence
from bert_mp.data.packing import pack_documents
from bert_mp.data.pairs import NspBalance, PairParams, PairStats, block_pairs, build_examples
from bert_mp.data.prepare.stats import sum_block_stats
from bert_mp.data.segment import (
    build_marker,
    count_markers,
    flatten_ids,
    mark_documents,
    mark_lines,
    mark_rule_in_pieces,
    marked_pieces,
    piece_bounds,
    split_marked_tokens,
)
from bert_mp.data.tokenizer import (
    count_special_token_texts,
    encoder,
    inline_markers,
    piece_cuts,
    plain_ascii_encoder,
    special_token_texts,
)

_STREAM_SPLIT = 3
_STATIC_MASK_EPOCH = 0


def hash_uniform(seed: int, stream: int, index: np.ndarray) -> np.ndarray:
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
    u = hash_uniform(seed, _STREAM_SPLIT, np.arange(n_docs))
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
        return tok, sum_block_stats([st for _, st in parts])


_ENCODE_BATCH = 256
"""Documents per ``encode_batch_fast`` call: a whole block in one call is 10-20% slower (every
Encoding of the block alive at once) than a few hundred at a time."""
PIECE_CHARS = 1 << 17
"""A text longer than this is encoded in pieces of at most this many characters (where the tokenizer
allows a cut: :func:`~bert_mp.data.tokenizer.piece_cuts`), and a call takes texts of at most
:data:`_BATCH_CHARS` characters in all: an ``Encoding`` holds ~90 bytes a character (its tokens,
offsets and masks), so a 16 MB document encoded whole held 1.4 GB (2 GB at its peak)."""
_BATCH_CHARS = 1 << 20


def encode_texts(enc: Any, texts: list[str], cuts: str | None = None) -> list[Any]:
    """Each text's ids from the Rust tokenizer ``enc``, in calls of at most :data:`_ENCODE_BATCH` texts
    and :data:`_BATCH_CHARS` characters; a text over :data:`PIECE_CHARS` in pieces cut before one of
    ``cuts`` (:func:`_encode_long`; None: whole), its ids one int32 array (a list of ids for every
    other text)."""
    if cuts is None or all(len(t) <= PIECE_CHARS for t in texts):
        return _encode_batches(enc, texts)
    out: list[Any] = [None] * len(texts)
    short = [i for i, t in enumerate(texts) if len(t) <= PIECE_CHARS]
    for i, ids in zip(short, _encode_batches(enc, [texts[i] for i in short]), strict=True):
        out[i] = ids
    for i in sorted(set(range(len(texts))) - set(short)):
        out[i] = _encode_long(enc, texts[i], cuts)
    return out


def _encode_batches(enc: Any, texts: list[str]) -> list[list[int]]:
    batch = enc.encode_batch_fast
    out: list[list[int]] = []
    lo = 0
    while lo < len(texts):
        hi, chars = lo + 1, len(texts[lo])
        while hi < len(texts) and hi - lo < _ENCODE_BATCH and chars + len(texts[hi]) <= _BATCH_CHARS:
            chars += len(texts[hi])
            hi += 1
        out.extend([e.ids for e in batch(texts[lo:hi], add_special_tokens=False)])
        lo = hi
    return out


def _encode_long(enc: Any, text: str, cuts: str) -> np.ndarray:
    """A long text's ids as one int32 array: its pieces (:func:`~bert_mp.data.segment.piece_bounds`)
    sliced and encoded a call's worth at a time, each piece's ids an array at once (a Python list
    holds ~36 bytes a token), so neither a copy of the text nor its ids as Python objects are alive
    whole."""
    bounds = piece_bounds(text, PIECE_CHARS, cuts)
    per_call = max(1, _BATCH_CHARS // PIECE_CHARS)
    arrays = []
    for k in range(0, len(bounds) - 1, per_call):
        pieces = [text[lo:hi] for lo, hi in itertools.pairwise(bounds[k : k + per_call + 1])]
        arrays += [
            np.asarray(e.ids, np.int32) for e in enc.encode_batch_fast(pieces, add_special_tokens=False)
        ]
    return np.concatenate(arrays)


class BlockPairer:
    """One block of documents in, its examples (an Arrow table) and its statistics out."""

    def __init__(self, docs: Any, tokenizer: Any, data: DataConfig):
        self.docs = docs
        self.encoder = encoder(tokenizer)
        self.ascii_encoder = plain_ascii_encoder(self.encoder)  # None where not proven equal
        self.cuts = piece_cuts(self.encoder)  # where a long text may be cut (None: encoded whole)
        self.cls_id, self.sep_id = int(tokenizer.cls_token_id), int(tokenizer.sep_token_id)
        self.splitter = data.sentence_splitter
        self.lines = data.documents == "line"
        self.mark = mark_lines if self.lines else build_marker(data.sentence_splitter)
        self.sep_token = tokenizer.sep_token
        self.specials = special_token_texts(self.encoder)
        self.inline = inline_markers(tokenizer, self.encoder)
        # the marker id of each choice (_choose_markers): the inline markers', then [SEP]'s
        self.marker_id_of = np.array([m for _, m in self.inline] + [self.sep_id], dtype=np.int32)
        # whether a document marked with each choice stays plain ASCII where its text is
        self.marker_is_ascii = np.array([c.isascii() for c, _ in self.inline] + [False])
        self.nsp = data.objective == "nsp"
        self.max_seq_length = data.max_seq_length
        self.params = PairParams(data.max_seq_length - 3, data.short_seq_prob, data.nsp_random_prob)
        self.spec = MaskingSpec.from_tokenizer(tokenizer, data) if data.masking == "static" else None
        self.seed, self.dupe_factor = data.seed, data.dupe_factor
        self.schema = _empty_table(self.spec is not None, self.nsp).schema
        self.tokenize_stage = "mark_and_tokenize" if self.nsp else "tokenize"

    def __setstate__(self, state: dict) -> None:  # a pairer sent to a spawned worker
        self.__dict__.update(state)
        for enc in (self.encoder, self.ascii_encoder):  # not part of a pickled Tokenizer
            if enc is not None:
                enc.encode_special_tokens = True

    def _encode(self, texts: list[str], plain: np.ndarray | None = None) -> list[list[int]]:
        """Each text's ids; ``plain``: the texts that are plain ASCII (:func:`plain_ascii`), which the
        faster :func:`plain_ascii_encoder` encodes to the same ids, where there is one."""
        if plain is None or self.ascii_encoder is None or not plain.any():
            return self._encode_with(self.encoder, texts, self.cuts)
        if plain.all():
            return self._encode_with(self.ascii_encoder, texts, self.cuts)
        out: list[list[int]] = [[]] * len(texts)
        for enc, idx in ((self.ascii_encoder, np.flatnonzero(plain)), (self.encoder, np.flatnonzero(~plain))):
            idx = idx.tolist()
            for i, ids in zip(idx, self._encode_with(enc, [texts[i] for i in idx], self.cuts), strict=True):
                out[i] = ids
        return out

    @staticmethod
    def _encode_with(enc: Any, texts: list[str], cuts: str | None = None) -> list[list[int]]:
        """Each text's ids (:func:`encode_texts`)."""
        return encode_texts(enc, texts, cuts)

    def _mark(self, texts: list[str], marker: str) -> tuple[list[str], list[int]]:
        if not self.lines and self.splitter == "rule" and any(len(t) > PIECE_CHARS for t in texts):
            marked, counts = [""] * len(texts), [0] * len(texts)
            short = [i for i, t in enumerate(texts) if len(t) <= PIECE_CHARS]
            for i, m, n in zip(short, *mark_documents([texts[i] for i in short], marker), strict=True):
                marked[i], counts[i] = m, n
            for i in set(range(len(texts))) - set(short):  # a long document: marked in pieces
                marked[i], counts[i] = mark_rule_in_pieces(texts[i], marker, PIECE_CHARS)
            return marked, counts
        if self.lines or self.splitter == "rule":  # one pass over the whole block
            return mark_documents(texts, marker, lines=self.lines)
        if not texts:
            return [], []
        marked, counts = zip(*(self.mark(t, marker) for t in texts), strict=True)
        return list(marked), list(counts)

    def _sentence_tokens(
        self, texts: list[str], st: dict, plain: np.ndarray | None = None
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
            if plain is not None:
                plain = plain & self.marker_is_ascii[choice]
            flat, doc_lens = flatten_ids(self._encode(marked, plain))
            del marked
            # Every inline marker must come back as exactly one marker id; a document where the
            # count differs (a normalizer that makes or eats the character) takes the [SEP] form.
            redo |= count_markers(flat, doc_lens, marker_ids) != counts
            if plain is not None:  # encoded by the plain-ASCII copy, and not redone below
                st["plain_ascii_documents"] = int((plain & ~redo).sum())
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
        plain = plain_ascii(column) if self.ascii_encoder is not None else None
        del column
        st["plain_ascii_documents"] = 0
        if self.nsp:
            (flat, doc_lens), marker_ids = self._sentence_tokens(texts, st, plain)
        else:
            (flat, doc_lens), marker_ids = flatten_ids(self._encode(texts, plain)), None
            st["plain_ascii_documents"] = 0 if plain is None else int(plain.sum())
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
