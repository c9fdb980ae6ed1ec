"""Sentence splitting: pure functions from a document's text to its sentences.

The built-in ``rule`` splitter is one regular-expression pass (fast enough never to dominate
tokenization): a sentence ends at ``.``, ``!`` or ``?`` (optionally followed by a closing quote or
bracket) before whitespace and an upper-case letter, digit or opening quote, and at every blank
line. Common abbreviations do not end a sentence. Pieces longer than ``max_chars`` (a table row, a
line of code, a paragraph without punctuation) are cut at whitespace so one "sentence" never
swallows a whole document.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from bert_mp.errors import DataError

# The sentence-final punctuation is captured (not looked behind): ``re.split`` then runs several
# times faster, and the pieces are re-joined with their punctuation.
_BOUNDARY = re.compile(
    r"([.!?][\"')\]]?)\s+(?=[\"'(\[]?[A-Z0-9])"  # sentence end before a capital, digit or opening quote
    r"|\n[ \t]*\n\s*"  # blank line
)
_ABBREVIATIONS = (
    "e.g.", "i.e.", "etc.", "cf.", "vs.", "Mr.", "Mrs.", "Ms.", "Dr.", "Prof.", "St.", "No.", "Fig.",
    "approx.", "resp.", "Jr.", "Sr.", "Inc.", "Ltd.", "U.S.",
)  # fmt: skip

Splitter = Callable[[str], list[str]]


def _cut_overlong(sentence: str, max_chars: int) -> list[str]:
    """Cut a piece longer than ``max_chars`` at whitespace (hard cut when there is none)."""
    out = []
    while len(sentence) > max_chars:
        cut = max(
            sentence.rfind(" ", max_chars // 2, max_chars), sentence.rfind("\n", max_chars // 2, max_chars)
        )
        if cut <= 0:
            cut = max_chars
        out.append(sentence[:cut].rstrip())
        sentence = sentence[cut:].lstrip()
    if sentence:
        out.append(sentence)
    return out


def _finish(pieces: list[str], max_chars: int) -> list[str]:
    """Merge pieces split after an abbreviation, strip them, drop empty ones, cut overlong ones.

    Inner whitespace is left alone: the tokenizer's pre-tokenizer splits on any of it anyway.
    """
    out: list[str] = []
    carry = ""
    for p in pieces:
        if carry:
            p = carry + " " + p
            carry = ""
        if p.endswith(_ABBREVIATIONS):
            carry = p
            continue
        p = p.strip()
        if not p:
            continue
        if len(p) > max_chars:
            out.extend(_cut_overlong(p, max_chars))
        else:
            out.append(p)
    carry = carry.strip()
    if carry:
        out.extend(_cut_overlong(carry, max_chars))
    return out


def split_sentences(text: str, max_chars: int = 2048) -> list[str]:
    """Sentences of ``text`` (rule-based), stripped, none empty, none over ``max_chars``."""
    parts = _BOUNDARY.split(text)
    # parts = [text, punctuation-or-None, text, punctuation-or-None, ..., text]
    pieces = [parts[i] + parts[i + 1] if parts[i + 1] else parts[i] for i in range(0, len(parts) - 1, 2)]
    pieces.append(parts[-1])
    return _finish(pieces, max_chars)


def build_splitter(name: str, max_chars: int = 2048) -> Splitter:
    """The splitter called ``name`` (``rule``, or ``nltk`` / ``blingfire`` when installed)."""
    if name == "rule":
        return lambda text: split_sentences(text, max_chars)
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
        return lambda text: _finish(
            [s for para in re.split(r"\n[ \t]*\n", text) for s in nltk.sent_tokenize(para)], max_chars
        )
    if name == "blingfire":
        try:
            import blingfire
        except ImportError:
            raise DataError("data.sentence_splitter=blingfire needs `pip install blingfire`") from None
        return lambda text: _finish(
            [
                s
                for para in re.split(r"\n[ \t]*\n", text)
                for s in blingfire.text_to_sentences(para).split("\n")
            ],
            max_chars,
        )
    raise DataError(f"unknown sentence splitter {name!r} (rule, nltk, blingfire)")
