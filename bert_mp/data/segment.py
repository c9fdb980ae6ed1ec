"""Sentence splitting: pure functions from a document's text to its sentences.

The built-in ``rule`` splitter is one regular-expression pass: a sentence ends at ``.``, ``!`` or
``?`` (optionally followed by a closing quote or bracket) before whitespace and an upper-case
letter, digit or opening quote - unless the punctuation ends a common abbreviation - and at every
blank line (a line holding only whitespace, Unicode spaces included: :mod:`bert_mp.data.whitespace`).

Two forms of the same boundaries: :func:`split_sentences` returns the sentences (tests, small
inputs); :func:`build_marker` rewrites a document so that a marker stands at every boundary.
``prepare`` uses the marked form: one ``encode_batch_fast`` input per document instead of one per
sentence, and sentence boundaries come back as marker ids in the token stream, with no Python list
of sentences in between. The marker is the tokenizer's ``[SEP]`` or, where it is proven
equivalent, a punctuation character (see ``bert_mp.data.tokenizer.inline_markers``), which the Rust
tokenizer handles without its slower special-token pass.
"""

from __future__ import annotations

import itertools
import operator
import re
from collections.abc import Callable, Iterator

import numpy as np

from bert_mp.data.whitespace import BLANK_LINES_RE, LINE_SPACE
from bert_mp.errors import DataError

_ABBREVIATIONS = (
    "e.g.", "i.e.", "etc.", "cf.", "vs.", "Mr.", "Mrs.", "Ms.", "Dr.", "Prof.", "St.", "No.", "Fig.",
    "approx.", "resp.", "Jr.", "Sr.", "Inc.", "Ltd.", "U.S.",
)  # fmt: skip
# The punctuation is captured (not looked behind) so the scan runs several times faster; the
# abbreviation look-behinds only run where a candidate boundary already matched, one per length
# (a look-behind must be of fixed width) rather than one per abbreviation: a quarter faster.
_ABBREVIATIONS_BY_LENGTH: dict[int, list[str]] = {}
for _a in _ABBREVIATIONS:
    _ABBREVIATIONS_BY_LENGTH.setdefault(len(_a), []).append(re.escape(_a[:-1]))
del _a
_SENTENCE_END = (
    r"([.!?][\"')\]]?)"
    + r"(?=\s+[\"'(\[]?[A-Z0-9])"  # ... before a capital, digit or opening quote
    + "".join(rf"(?<!\b(?:{'|'.join(v)})\.)" for _, v in sorted(_ABBREVIATIONS_BY_LENGTH.items()))
    + r"\s+"
)
_BLANK = rf"\n{LINE_SPACE}*\n\s*"
_BOUNDARY = re.compile(_SENTENCE_END + "|" + _BLANK)
# The same boundaries in two passes (used to mark): a pattern that starts with a character class
# is scanned for it at C speed, the alternation is not - half the time per document. Equal to one
# pass with _BOUNDARY because a sentence-end match consumes all whitespace after it (blank lines
# included) and a blank-line match spans whitespace only, where no sentence end can start.
_SENTENCE_END_RE = re.compile(_SENTENCE_END)
_BLANK_RE = re.compile(_BLANK)

Splitter = Callable[[str], list[str]]
Marker = Callable[[str, str], tuple[str, int]]
"""``(text, marker) -> (marked text, number of markers in it)``."""


def _cut_overlong(sentence: str, max_chars: int) -> list[str]:
    """Cut a piece longer than ``max_chars`` at whitespace (hard cut when there is none).

    The last cut splits what is left into two halves of about equal length rather than a full
    piece and a tail, so a cut never leaves a short tail such as a lone ".".
    """
    out = []
    while len(sentence) > max_chars:
        if len(sentence) <= 2 * max_chars:
            lo, mid, hi = len(sentence) - max_chars, len(sentence) // 2, max_chars
            before = max(sentence.rfind(" ", lo, mid), sentence.rfind("\n", lo, mid))
            after = [i for i in (sentence.find(" ", mid, hi), sentence.find("\n", mid, hi)) if i >= 0]
            options = [i for i in (before, min(after, default=-1)) if i > 0]
            cut = min(options, key=lambda i: abs(i - mid)) if options else mid
        else:
            cut = max(
                sentence.rfind(" ", max_chars // 2, max_chars),
                sentence.rfind("\n", max_chars // 2, max_chars),
            )
            if cut <= 0:
                cut = max_chars
        out.append(sentence[:cut].rstrip())
        sentence = sentence[cut:].lstrip()
    if sentence:
        out.append(sentence)
    return out


def _finish(pieces: list[str], max_chars: int) -> list[str]:
    """Strip pieces, drop empty ones, cut overlong ones (inner whitespace is left alone)."""
    out: list[str] = []
    for p in pieces:
        p = p.strip()
        if len(p) > max_chars:
            out.extend(_cut_overlong(p, max_chars))
        elif p:
            out.append(p)
    return out


def split_sentences(text: str, max_chars: int = 2048) -> list[str]:
    """Sentences of ``text`` (rule-based), stripped, none empty, none over ``max_chars``."""
    parts = _BOUNDARY.split(text)
    # parts = [text, punctuation-or-None, text, punctuation-or-None, ..., text]
    pieces = [parts[i] + parts[i + 1] if parts[i + 1] else parts[i] for i in range(0, len(parts) - 1, 2)]
    pieces.append(parts[-1])
    return _finish(pieces, max_chars)


def _mark_rule(text: str, marker: str) -> tuple[str, int]:
    """``text`` with ``marker`` at every rule boundary (replacing the whitespace there) and at the
    end, and the number of markers."""
    # Split at sentence ends and join with the marker: every step runs in C. (A substitution
    # template with the group reference expands in Python once per boundary before Python 3.12,
    # ~40% slower.) parts = [text, punctuation, text, punctuation, ..., text].
    parts = _SENTENCE_END_RE.split(text.strip())
    marked = marker.join([*map(operator.add, parts[0:-1:2], parts[1::2]), parts[-1]])
    marked, m = _BLANK_RE.subn(marker.replace("\\", "\\\\"), marked)  # a literal template
    return marked + marker, len(parts) // 2 + m + 1


def mark_rule_in_pieces(text: str, marker: str, size: int) -> tuple[str, int]:
    """:func:`_mark_rule` of a long ``text``, in pieces of at most about ``size`` characters, so the
    marking's intermediate lists and copies are a piece's, not the document's. Each piece ends at a
    rule boundary (the next piece starts after all the whitespace the boundary takes, at a
    non-space): marked alone, it ends in the marker that stands there in the whole text (after the
    spaces a blank line's boundary leaves before it), and no boundary's look-ahead or look-behind
    reaches across the cut. A stretch of ``size`` characters without a boundary is marked with what
    follows it."""
    text = text.strip()
    out: list[str] = []
    count, start = 0, 0
    while len(text) - start > size:
        last = None
        for lo in (start + size // 2, start):  # the piece's second half first, then all of it
            for m in _BOUNDARY.finditer(text, lo, start + size):
                if m.end() < start + size:  # not cut short by the end of the search
                    last = m
            if last is not None:
                break
        if last is None:  # no boundary here: this stretch goes with the next piece
            last = _BOUNDARY.search(text, start + size)
            if last is None:
                break
        if last.group(1) is None:  # a blank line: the spaces before it stay, as in the whole
            body = text[start : last.start()]
            marked, n = _mark_rule(body, marker)
            marked = marked[: -len(marker)] + body[len(body.rstrip()) :] + marker
        else:
            marked, n = _mark_rule(text[start : last.end(1)], marker)
        out.append(marked)
        count += n
        start = last.end()
    marked, n = _mark_rule(text[start:], marker)
    return "".join([*out, marked]), count + n


_DOC_DELIMITER = "\x00"


def mark_documents(texts: list[str], marker: str, lines: bool = False) -> tuple[list[str], list[int]]:
    """``[_mark_rule(t, marker) for t in texts]`` (or the line form) in one pass over the joined text.

    The documents are joined with NUL, which is neither whitespace nor a word character: no rule
    boundary, abbreviation look-behind or blank-line match can span it, so every document is marked
    exactly as alone - one regular-expression pass per block instead of one call per document,
    which dominates marking on corpora of short documents. Texts that contain NUL or the marker
    are marked one by one. ``lines``: the line form (:func:`mark_lines`). Returns the marked texts
    and the number of markers in each.
    """
    one = mark_lines if lines else _mark_rule
    if not texts:
        return [], []
    joined = _DOC_DELIMITER.join(map(str.strip, texts))
    if _DOC_DELIMITER in marker or joined.count(_DOC_DELIMITER) != len(texts) - 1 or marker in joined:
        marked, counts = zip(*(one(t, marker) for t in texts), strict=True)
        return list(marked), list(counts)
    if lines:
        big = joined.replace("\n", marker)
    else:
        parts = _SENTENCE_END_RE.split(joined)
        big = marker.join([*map(operator.add, parts[0:-1:2], parts[1::2]), parts[-1]])
        big = _BLANK_RE.sub(marker.replace("\\", "\\\\"), big)
    marked = big.replace(_DOC_DELIMITER, marker + _DOC_DELIMITER).split(_DOC_DELIMITER)
    marked[-1] += marker
    return marked, list(map(str.count, marked, itertools.repeat(marker)))


def mark_lines(text: str, marker: str) -> tuple[str, int]:
    """``text`` with ``marker`` after every line (Google's input format: a line is a sentence).

    Lines are not re-split; leading and trailing whitespace of the document is dropped, and a
    document never holds a blank line (blank lines separate documents when it is read).
    """
    stripped = text.strip()
    return stripped.replace("\n", marker) + marker, stripped.count("\n") + 1


def _unused_characters() -> Iterator[str]:
    yield "\x00"
    for lo, hi in ((0xE000, 0xF900), (0xF0000, 0xFFFFE), (0x100000, 0x10FFFE)):  # private use
        yield from map(chr, range(lo, hi))


def unused_character(text: str) -> str:
    """A character that ``text`` does not contain: NUL, or else the first free private-use one."""
    for c in _unused_characters():
        if c not in text:
            return c
    raise DataError("a document holds NUL and every private-use character; bert_mp cannot mark its sentences")


def marked_pieces(text: str, mark: Marker) -> list[str]:
    """The sentences of ``text`` as ``mark`` marks them: the pieces between its markers, untouched
    (not stripped, empty ones kept), so encoding them one by one gives what the marked text gives."""
    delimiter = unused_character(text)
    marked, n = mark(text, delimiter)
    pieces = marked.split(delimiter)
    assert len(pieces) == n + 1 and pieces[-1] == "", "a marker does not end every marked sentence"
    return pieces[:-1]


def _optional_splitter(name: str) -> Callable[[str], list[str]]:
    if name == "nltk":
        try:
            import nltk

            nltk.sent_tokenize("Probe. Sentence.")
        except ImportError:
            raise DataError("data.sentence_splitter=nltk needs `pip install nltk`") from None
        except LookupError:
            raise DataError(
                "data.sentence_splitter=nltk needs the punkt model: python -m nltk.downloader punkt_tab"
            ) from None
        return lambda para: nltk.sent_tokenize(para)
    if name == "blingfire":
        try:
            import blingfire
        except ImportError:
            raise DataError("data.sentence_splitter=blingfire needs `pip install blingfire`") from None
        return lambda para: blingfire.text_to_sentences(para).split("\n")
    raise DataError(f"unknown sentence splitter {name!r} (rule, nltk, blingfire)")


def build_splitter(name: str, max_chars: int = 2048) -> Splitter:
    """The splitter called ``name`` (``rule``, or ``nltk`` / ``blingfire`` when installed)."""
    if name == "rule":
        return lambda text: split_sentences(text, max_chars)
    split = _optional_splitter(name)
    return lambda text: _finish([s for para in BLANK_LINES_RE.split(text) for s in split(para)], max_chars)


def build_marker(name: str) -> Marker:
    """``(text, marker) -> (marked, count)``: ``marker`` after every sentence of the splitter ``name``."""
    if name == "rule":
        return _mark_rule
    split = build_splitter(name, max_chars=1 << 62)

    def mark(text: str, marker: str) -> tuple[str, int]:
        sentences = split(text)
        return "".join(s + marker for s in sentences), len(sentences)

    return mark


def cut_into_pieces(text: str, size: int, cuts: str) -> list[str]:
    """``text`` in consecutive pieces of at most ``size`` characters (:func:`piece_bounds`); joined
    back they are ``text``."""
    bounds = piece_bounds(text, size, cuts)
    return [text[lo:hi] for lo, hi in itertools.pairwise(bounds)]


def piece_bounds(text: str, size: int, cuts: str) -> list[int]:
    """Where :func:`cut_into_pieces` cuts ``text`` (0 first, ``len(text)`` last): each cut just before
    one of the characters ``cuts`` (``bert_mp.data.tokenizer.piece_cuts``: where the tokenizer
    starts a new word whatever came before), the last such character of the piece's second half -
    or of the whole piece, or, with none of them in ``size`` characters, at ``size`` (a "word" that
    long is one ``[UNK]`` to WordPiece, and a few ``[UNK]`` cut apart)."""
    bounds, start = [0], 0
    while len(text) - start > size:
        end = start + size
        cut = max(text.rfind(c, start + size // 2, end) for c in cuts)
        if cut <= start:
            cut = max(text.rfind(c, start + 1, end) for c in cuts)
        if cut <= start:
            cut = end
        bounds.append(cut)
        start = cut
    return [*bounds, len(text)]


def flatten_ids(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Token id lists (or arrays) as one flat int32 array and each list's length."""
    doc_lens = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    if any(isinstance(x, np.ndarray) for x in ids):  # a long document's: no per-token Python work
        return np.concatenate([np.asarray(x, np.int32) for x in ids] or [np.zeros(0, np.int32)]), doc_lens
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(doc_lens.sum()))
    return flat, doc_lens


def _marker_mask(flat: np.ndarray, doc_lens: np.ndarray, marker_id: int | np.ndarray) -> np.ndarray:
    if np.ndim(marker_id):
        return flat == np.repeat(np.asarray(marker_id, dtype=np.int32), doc_lens)
    return flat == marker_id


def count_markers(flat: np.ndarray, doc_lens: np.ndarray, marker_id: int | np.ndarray) -> np.ndarray:
    """Marker ids in each document of ``flat`` (documents of ``doc_lens`` tokens, one marker id
    for all or one per document), without a per-document Python call."""
    seen = np.zeros(flat.size + 1, dtype=np.int64)
    np.cumsum(_marker_mask(flat, doc_lens, marker_id), out=seen[1:])
    ends = np.cumsum(doc_lens)
    return seen[ends] - seen[ends - doc_lens]


def split_marked_tokens(
    ids: list[list[int]] | tuple[np.ndarray, np.ndarray], marker_id: int | np.ndarray, max_tokens: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """Sentences from the token ids of marked documents (``marker_id`` after every sentence).

    ``ids``: one list per document, or the ``(flat, doc_lens)`` of :func:`flatten_ids`.
    ``marker_id`` is one id for all documents or an array with one per document.

    Returns ``(flat, lengths, document, empty, cut)``: all sentence tokens in order without the
    markers, the length of each sentence and its document's position in ``ids``, the number of
    sentences without tokens (dropped) and the number cut into pieces of at most ``max_tokens`` (a
    sentence longer than a whole example would otherwise lose everything past its first piece).
    """
    flat, doc_lens = ids if isinstance(ids, tuple) else flatten_ids(ids)
    is_marker = _marker_mask(flat, doc_lens, marker_id)
    doc_ends = np.cumsum(doc_lens)
    if not is_marker[doc_ends[doc_lens > 0] - 1].all():
        raise DataError(
            "the tokenizer does not keep its [SEP] token when it appears in text; bert_mp needs that"
        )
    marker_pos = np.flatnonzero(is_marker)
    starts = np.zeros_like(marker_pos)
    starts[1:] = marker_pos[:-1] + 1
    lengths = marker_pos - starts
    document = np.searchsorted(doc_ends, marker_pos, side="right")
    pieces = (lengths + max_tokens - 1) // max_tokens  # 0 for an empty sentence
    has = pieces > 0
    # a sentence longer than max_tokens is cut into k pieces of near-equal length (the first
    # L % k one token longer), so no piece is a short tail such as a lone "."
    k, length = pieces[has], lengths[has]
    piece_len = np.repeat(length // k, k)
    within = np.arange(piece_len.size) - np.repeat(np.cumsum(k) - k, k)
    piece_len += within < np.repeat(length % k, k)
    return (
        flat[~is_marker],
        piece_len,
        np.repeat(document, pieces),
        int((~has).sum()),
        int((pieces > 1).sum()),
    )
