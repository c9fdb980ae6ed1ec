"""Generated English-like text for prepare at scale: documents of realistic length, no two alike.

Repeating a real corpus (``bench/prepare.py``'s shapes) gives a vocabulary and a word distribution
that stop growing after the first copy and duplicate documents; a vocabulary trained on such a
corpus costs nothing like a real one. Here every word is drawn afresh:

- words from the built-in corpus's own word frequencies (English prose, Zipf-distributed), with 3%
  turned into new words (a word plus 2-5 random letters: names, typos, rare forms; a corpus's
  distinct words keep growing with its size, as Heaps' law says of real text) and 1% numbers;
- sentences of 3-80 words (log-normal, median 18), the first word capitalized, a full stop after
  the last, commas inside; a line break after one sentence in five;
- documents of 80-100,000 characters (log-normal, median 1,500: mean ~2,500, close to a Wikipedia
  article's text), blank lines between them, ``--file-bytes`` per file.

Every file is generated from ``(seed, file index)``, so the corpus is the same on every run; its
``.manifest.json`` records the documents, characters, distinct words and duplicate documents (a
128-bit hash of every document; expected 0).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import numpy as np

VERSION = 1
"""Bumped when the generator changes, so a cached corpus of another version is regenerated."""
FILE_BYTES = 1_000_000
MANIFEST = ".manifest.json"
"""Hidden: a folder given as ``data.paths`` is read without it."""
NEW_WORD_SHARE, NUMBER_SHARE, COMMA_SHARE, LINE_BREAK_SHARE = 0.03, 0.01, 0.06, 0.2
DOC_CHARS_MEDIAN, DOC_CHARS_SIGMA, DOC_CHARS_RANGE = 1500.0, 1.0, (80, 100_000)
SENT_WORDS_MEDIAN, SENT_WORDS_SIGMA, SENT_WORDS_RANGE = 18.0, 0.5, (3, 80)
_LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))


def word_table(texts: Iterable[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The lowercase words of ``texts`` (default: the built-in corpus) and their cumulative
    probabilities."""
    if texts is None:
        from bert_mp.data.builtin_corpus import builtin_documents

        texts = (d["text"] for d in builtin_documents())
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(w.lower() for w in re.findall(r"[A-Za-z]+(?:'[a-z]+)?", text))
    words, n = zip(*sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])), strict=True)
    p = np.asarray(n, dtype=np.float64)
    return np.asarray(words, dtype=object), np.cumsum(p / p.sum())


def _words(rng: np.random.Generator, table: tuple[np.ndarray, np.ndarray], n: int) -> np.ndarray:
    """``n`` words: drawn by frequency, some made new, some numbers."""
    vocab, cum = table
    words = vocab[np.minimum(np.searchsorted(cum, rng.random(n)), len(vocab) - 1)]
    new = np.flatnonzero(rng.random(n) < NEW_WORD_SHARE)
    tails = rng.integers(0, len(_LETTERS), size=(new.size, 5))
    cut = rng.integers(2, 6, size=new.size)
    words[new] = [w + "".join(_LETTERS[t[:k]]) for w, t, k in zip(words[new], tails, cut, strict=True)]
    num = np.flatnonzero(rng.random(n) < NUMBER_SHARE)
    words[num] = rng.integers(0, 100_000, size=num.size).astype(str).astype(object)
    return words


def _lognormal(rng: np.random.Generator, median: float, sigma: float, bounds: tuple, n: int) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), *bounds).astype(np.int64)


def file_text(seed: int, index: int, size: int, table: tuple[np.ndarray, np.ndarray]) -> list[str]:
    """The documents of file ``index``: about ``size`` characters, from ``(seed, index)`` only."""
    rng = np.random.default_rng([seed, index])
    n_words = max(64, size // 6)  # ~5.2 letters and a space a word
    sent = _lognormal(rng, SENT_WORDS_MEDIAN, SENT_WORDS_SIGMA, SENT_WORDS_RANGE, n_words // 3 + 1)
    ends = np.cumsum(sent)
    sent = sent[: int(np.searchsorted(ends, n_words)) + 1]
    ends = np.cumsum(sent)
    words = _words(rng, table, int(ends[-1]))
    starts = ends - sent
    words[starts] = [w[:1].upper() + w[1:] for w in words[starts]]
    comma = np.flatnonzero(rng.random(words.size) < COMMA_SHARE)
    words[comma] = [w + "," for w in words[comma]]
    breaks = rng.random(sent.size) < LINE_BREAK_SHARE
    words[ends - 1] = [
        w.rstrip(",") + (".\n" if b else ".") for w, b in zip(words[ends - 1], breaks, strict=True)
    ]
    sentences = [" ".join(words[a:b]).replace("\n ", "\n").strip() for a, b in zip(starts, ends, strict=True)]
    # documents: runs of whole sentences of about a drawn number of characters each
    lens = np.cumsum([len(s) + 1 for s in sentences])
    targets = np.cumsum(_lognormal(rng, DOC_CHARS_MEDIAN, DOC_CHARS_SIGMA, DOC_CHARS_RANGE, len(sentences)))
    cuts = np.unique(np.minimum(np.searchsorted(lens, targets[targets < lens[-1]]) + 1, len(sentences)))
    bounds = [0, *cuts.tolist()]
    if bounds[-1] != len(sentences):
        bounds.append(len(sentences))
    return [" ".join(sentences[a:b]).replace("\n ", "\n") for a, b in zip(bounds, bounds[1:]) if b > a]


def write_generated_corpus(
    folder: Path, size: int, seed: int = 0, file_bytes: int = FILE_BYTES, table: tuple | None = None
) -> list[Path]:
    """About ``size`` bytes of generated text in ``folder`` (``part-NNNNN.txt``), reused when a
    complete corpus of the same size, seed and generator version is there. ``table``: the words
    (:func:`word_table`; default the built-in corpus's)."""
    folder.mkdir(parents=True, exist_ok=True)
    manifest = folder / MANIFEST
    want = {"version": VERSION, "size": size, "seed": seed, "file_bytes": file_bytes}
    if manifest.is_file() and json.loads(manifest.read_text()).get("request") == want:
        return sorted(folder.glob("part-*.txt"))
    manifest.unlink(missing_ok=True)
    for old in folder.glob("part-*.txt"):
        old.unlink()
    table = word_table() if table is None else table
    hashes: set[bytes] = set()
    docs = chars = written = dupes = 0
    distinct: set[str] = set()
    index = 0
    while written < size:
        texts = file_text(seed, index, min(file_bytes, size - written), table)
        for t in texts:
            h = hashlib.blake2b(t.encode(), digest_size=16).digest()
            dupes += h in hashes
            hashes.add(h)
        if index < 8:  # distinct words of the first files (a sample: all of them would cost memory)
            distinct.update(re.findall(r"[A-Za-z]+", " ".join(texts).lower()))
        data = ("\n\n".join(texts) + "\n").encode()
        (folder / f"part-{index:05d}.txt").write_bytes(data)
        written += len(data)
        docs += len(texts)
        chars += sum(map(len, texts))
        index += 1
    record = {
        "request": want,
        "files": index,
        "bytes": written,
        "documents": docs,
        "characters": chars,
        "mean_document_characters": chars / docs,
        "duplicate_documents": dupes,
        "distinct_words_first_8_files": len(distinct),
    }
    manifest.write_text(json.dumps(record, indent=1) + "\n")
    return sorted(folder.glob("part-*.txt"))


def manifest(folder: Path) -> dict:
    """What :func:`write_generated_corpus` recorded about the corpus in ``folder``."""
    return json.loads((folder / MANIFEST).read_text())
