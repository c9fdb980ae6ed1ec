"""WordPiece tokenizer: train on the corpus, or load a pretrained one; save so AutoTokenizer loads it.

The Hugging Face tokenizer is built from the trained ``tokenizers`` object itself. (With
transformers 5.x, ``BertTokenizerFast(vocab_file=...)`` silently builds a 5-token vocabulary.)
The model vocabulary is the tokenizer size rounded up to a multiple of 64 (tensor-core friendly:
BERT's 30522 becomes 30528).
"""

from __future__ import annotations

import sys
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bert_mp.data.arrow_text import utf8_chunks
from bert_mp.errors import DataError

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CONTINUING_PREFIX = "##"


_CJK = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF),
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)
"""The CJK ideographs BERT's normalizer (``handle_chinese_chars``) makes words of their own."""


def _may_continue(char: str) -> bool:
    """Whether ``char`` can sit inside a word after BERT's normalizer and pre-tokenizer: not
    whitespace, not punctuation (ASCII symbols or a Unicode ``P*`` category) and not a CJK
    ideograph, which are all split off as words of their own."""
    if char.isspace() or (char.isascii() and not char.isalnum()):
        return False
    if any(lo <= ord(char) <= hi for lo, hi in _CJK):
        return False
    return not unicodedata.category(char).startswith("P")


def round_vocab_size(size: int, multiple: int = 64) -> int:
    """``size`` rounded up to a multiple of ``multiple``."""
    return -(-size // multiple) * multiple


def continuing_pieces(normalizer: Any, characters: Iterable[str]) -> list[str]:
    """The ``##c`` word pieces of a text whose distinct characters are ``characters``, sorted: one
    for every character ``c`` of the normalized text that can sit inside a word.

    Only the distinct characters are normalized, each alone: BERT's normalizer (control characters
    removed, whitespace made a space, CJK ideographs spaced, accents stripped by NFD, lowercase) maps
    every character on its own, so the normalized text's characters are the union of the
    characters' normalized forms (tested against normalizing whole texts)."""
    normalized: set[str] = set()
    for c in characters:
        normalized.update(normalizer.normalize_str(c))
    return [CONTINUING_PREFIX + c for c in sorted(normalized) if _may_continue(c)]


def train_wordpiece(
    texts: Iterable[str] | Callable[[], Iterator[Any]],
    vocab_size: int,
    lowercase: bool = True,
    length: int | None = None,
    characters: Iterable[str] | None = None,
) -> Any:
    """Train a BERT WordPiece tokenizer on ``texts``; returns a ``BertTokenizerFast``. The same texts
    give the same vocabulary in every process.

    ``texts``: a function returning a fresh iterator over the texts (or over lists of texts), or an
    iterable (an iterator is held in memory). ``characters``: every distinct character of the texts,
    where the caller has them (``bert_mp.data.arrow_text.distinct_characters`` finds them in Arrow
    text without a Python pass); otherwise they are collected here in a first pass over ``texts``.

    ``tokenizers``' trainer alone is not reproducible (huggingface/tokenizers#1794): it creates a
    continuing-subword token (``##c``) the first time it meets ``c`` inside a word while iterating a
    hash map in a per-process random order, and those ids break the ties between merges of equal
    count, so two runs on the same text can learn different vocabularies. Here every ``##c`` of the
    alphabet is registered, in sorted order, before training (as a special token of the trainer), so
    no id depends on that order; the tokenizer is then rebuilt on the learned vocabulary with only
    BERT's five special tokens (a literal ``##a`` in a text stays ordinary text).
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    if not callable(texts):
        kept = texts if not isinstance(texts, Iterator) else list(texts)
        texts = lambda: iter(kept)  # noqa: E731

    def pipeline(tk: Any) -> Any:
        tk.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, lowercase=lowercase
        )
        tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tk.decoder = decoders.WordPiece(prefix=CONTINUING_PREFIX)
        return tk

    draft = pipeline(Tokenizer(models.WordPiece(unk_token="[UNK]")))
    if characters is None:
        found: set[str] = set()
        for item in texts():
            for text in [item] if isinstance(item, str) else item:
                found.update(text)
        characters = found
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS, *continuing_pieces(draft.normalizer, characters)],
        continuing_subword_prefix=CONTINUING_PREFIX,
        # tokenizers draws its bars on stdout; without a terminal it writes only blank lines there
        show_progress=sys.stdout.isatty(),
    )
    draft.train_from_iterator(texts(), trainer=trainer, length=length)
    vocab = draft.get_vocab(with_added_tokens=False)
    tk = pipeline(
        Tokenizer(
            models.WordPiece(vocab=vocab, unk_token="[UNK]", continuing_subword_prefix=CONTINUING_PREFIX)
        )
    )
    tk.add_special_tokens(SPECIAL_TOKENS)
    cls_id, sep_id = tk.token_to_id("[CLS]"), tk.token_to_id("[SEP]")
    tk.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    hf = BertTokenizerFast(tokenizer_object=tk, do_lower_case=lowercase)
    if len(hf) != tk.get_vocab_size():
        raise RuntimeError(f"tokenizer wrapper lost tokens: {len(hf)} != {tk.get_vocab_size()}")
    return hf


def load_tokenizer(name_or_path: str, max_seq_length: int | None = None) -> Any:
    """A pretrained fast tokenizer by Hub name or local path, checked for what BERT data needs."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name_or_path)
    except Exception as e:  # missing path, offline Hub, broken files
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"data.tokenizer: cannot load {name_or_path!r}: {first}") from None
    if not getattr(tok, "is_fast", False):
        raise DataError(f"data.tokenizer: {name_or_path!r} has no fast (Rust) tokenizer; bert_mp needs one")
    missing = [
        n for n in ("cls_token", "sep_token", "mask_token", "pad_token") if getattr(tok, n, None) is None
    ]
    if missing:
        raise DataError(
            f"data.tokenizer: {name_or_path!r} lacks {', '.join(missing)} needed for BERT pretraining"
        )
    limit = getattr(tok, "model_max_length", None)
    if max_seq_length is not None and limit is not None and limit < max_seq_length:
        raise DataError(
            f"data.max_seq_length={max_seq_length} exceeds the tokenizer's model_max_length={limit} ({name_or_path})"
        )
    return tok


def encoder(tokenizer: Any) -> Any:
    """A copy of the Rust tokenizer for raw text, for ``encode_batch_fast``: truncation and padding
    off, and special tokens written in the text (``[SEP]``, ``[MASK]``, ...) tokenized as the text
    they are (``encode_special_tokens``), never as the special token: a ``[SEP]`` in a corpus is no
    sentence or document boundary, a ``[MASK]`` no mask. The setting is not part of a pickled
    ``Tokenizer``: set it again after unpickling (``prepare.blocks.BlockPairer`` does)."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = True
    return backend


def plain_ascii_encoder(enc: Any) -> Any | None:
    """A copy of the :func:`encoder` ``enc`` that gives the same ids on plain-ASCII text
    (:func:`bert_mp.data.arrow_text.plain_ascii`: printable ASCII, tab, line feed, carriage return)
    about a third faster, or None where that is not proven.

    BERT's normalizer cleans the text (drops control characters, turns whitespace into spaces),
    spaces out CJK characters, strips accents (Unicode NFD, then the combining marks dropped) and
    lowercases. On plain ASCII only the lowercasing changes a character: NFD leaves ASCII as it is,
    the three whitespace characters kept are whitespace to ``BertPreTokenizer`` either way, and the
    other control characters are not plain. So where the normalizer is ``BertNormalizer``, the
    pre-tokenizer ``BertPreTokenizer`` and no added token but the special ones (their text is text
    here, :func:`encoder`), ``Lowercase`` (or no normalizer, for a cased tokenizer) gives the same
    words, hence the same ids, without the Unicode passes: 1.07 s against 1.56 s for 2,500
    generated documents of 2,400 characters (2-vCPU EPYC, tokenizers 0.23; tested equal on
    generated plain text, the special tokens' texts and the markers included).
    """
    import json

    from tokenizers import Tokenizer, normalizers

    text = enc.to_str()
    spec = json.loads(text)
    norm, pre = spec.get("normalizer") or {}, spec.get("pre_tokenizer") or {}
    if norm.get("type") != "BertNormalizer" or pre.get("type") != "BertPreTokenizer":
        return None
    if any(not t.get("special") for t in spec.get("added_tokens") or []):
        return None
    fast = Tokenizer.from_str(text)
    fast.normalizer = normalizers.Lowercase() if norm.get("lowercase") else None
    fast.encode_special_tokens = enc.encode_special_tokens
    return fast


_CUT_NORMALIZERS = frozenset(
    {"BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "StripAccents", "Strip"}
)
"""Normalizers that change each character alone (a cut at whitespace never joins or parts what they see)."""
_CUT_PRE_TOKENIZERS = {"BertPreTokenizer": True, "Whitespace": False, "WhitespaceSplit": False}
"""Pre-tokenizers that split words at whitespace and drop it; True: each punctuation character is a
word of its own too."""
WHITESPACE_CUTS = " \n\t"


def piece_cuts(enc: Any) -> str | None:
    """The characters before which a text may be cut, each piece encoded alone, with the same ids as
    the whole text (:func:`bert_mp.data.segment.cut_into_pieces`): whitespace, and ASCII
    punctuation where the pre-tokenizer isolates every punctuation character (but those inside an
    added token's text, such as ``]`` of ``[SEP]``, which prepare writes as a marker). None where that is not
    proven: a normalizer that may look across characters (a regular expression, a precompiled
    map), a pre-tokenizer that keeps whitespace with a word (byte-level BPE, SentencePiece's
    Metaspace), or a non-special added token that holds a space (matched before the cut could be
    seen)."""
    import json
    import string

    spec = json.loads(enc.to_str())
    norm = spec.get("normalizer") or {}
    norms = norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm] if norm else []
    if any(n.get("type") not in _CUT_NORMALIZERS for n in norms):
        return None
    punctuation = _CUT_PRE_TOKENIZERS.get((spec.get("pre_tokenizer") or {}).get("type"))
    if punctuation is None:
        return None
    added = spec.get("added_tokens") or []
    if any(not t.get("special") and any(c.isspace() for c in t["content"]) for t in added):
        return None
    if not punctuation:
        return WHITESPACE_CUTS
    inside = {c for t in added for c in t["content"][1:]}  # a cut never parts a special token's text
    return WHITESPACE_CUTS + "".join(c for c in string.punctuation if c not in inside)


def special_token_texts(enc: Any) -> list[str]:
    """The text of every special token of the Rust tokenizer ``enc``, in id order."""
    return [t.content for _, t in sorted(enc.get_added_tokens_decoder().items()) if t.special]


def count_special_token_texts(texts: Any, specials: list[str]) -> dict[str, int]:
    """How often each special token's text occurs in the Arrow strings ``texts`` (an array or a
    chunked array), for the tokens that occur: what :func:`encoder` tokenizes as text. A match
    never spans two strings.

    Vectorized over the UTF-8 bytes: one comparison per byte for each distinct first byte, then
    the following bytes only at the candidates (UTF-8 is self-synchronizing, so a byte match of a
    whole string's encoding is a character match); no Python work per document.
    """
    found = dict.fromkeys(specials, 0)
    for data, offsets in utf8_chunks(texts):
        if data.size == 0:
            continue
        starts: dict[int, np.ndarray] = {}
        for special in specials:
            pattern = special.encode("utf-8")
            if pattern[0] not in starts:
                starts[pattern[0]] = np.flatnonzero(data == pattern[0])
            at = starts[pattern[0]]
            at = at[at + len(pattern) <= data.size]
            for k in range(1, len(pattern)):
                at = at[data[at + k] == pattern[k]]
            # in one string: the string of its first byte is the string of its last
            same = np.searchsorted(offsets, at, "right") == np.searchsorted(
                offsets, at + len(pattern) - 1, "right"
            )
            found[special] += int(same.sum())
    return {s: n for s, n in found.items() if n}


# Punctuation characters tried as inline sentence markers, rarest in prose first; a document takes
# the first that it does not contain. ASCII ones first: a non-ASCII marker makes an ASCII document
# non-ASCII, which the Rust tokenizer encodes ~14% slower (2,000 built-in documents, best of 5).
_INLINE_MARKER_CANDIDATES = "|~^`@#$%&*+<=>\\{}_\u00b6\u00a7"
# Sentences a candidate must handle exactly as [SEP] does (none contains a candidate).
_MARKER_PROBES = (
    "One sentence.",
    "Two words!",
    '"Quoted," she said.',
    "(Bracketed) e.g. this: 3.5 of [things], 1,000 items",
    "\u00c7a va tr\u00e8s bien. Na\u00efve caf\u00e9 \u00fcber STRASSE",
    "\u65e5\u672c\u8a9e\u306e\u6587\u3002\u6b21",
    "tab\there\nnew line   spaces",
    "x",
    "unbelievably antidisestablishmentarianism",
    "\u0645\u0631\u062d\u0628\u0627 \u05e9\u05dc\u05d5\u05dd",
)


def inline_markers(tokenizer: Any, enc: Any = None) -> list[tuple[str, int]]:
    """Punctuation characters that can stand in for ``[SEP]`` as prepare's sentence marker, with
    their ids, in the order prepare tries them; empty where none is proven equivalent.

    The *[SEP] form* of a document is every sentence encoded alone with ``[SEP]``'s id after each
    (one ``encode_batch_fast`` input per sentence, where the marked form is one per document; the
    text itself cannot carry ``[SEP]``, since a ``[SEP]`` written in a corpus is tokenized as text:
    :func:`encoder`). BERT's pre-tokenizer isolates every punctuation character, so such a character
    marks the boundaries inline. A candidate is kept only where (1) the pre-tokenizer is
    ``BertPreTokenizer``, so the words on either side are those of separately tokenized sentences;
    (2) the character alone encodes to one token, a regular one or ``[UNK]`` (not in the
    vocabulary: a vocabulary learned from text without any candidate character, where every
    document would otherwise take the [SEP] form, 15-25% slower); (3) on probe sentences the ids
    equal those of the [SEP] form with that one id swapped. The candidates of a regular token come
    first, then those of ``[UNK]``. A document takes the first candidate it does not contain (the
    [SEP] form if it contains them all), and prepare checks the marker count of every document (see
    ``prepare.blocks.BlockPairer``): a document holding a word that is ``[UNK]`` itself counts more
    ``[UNK]`` than markers and takes the [SEP] form. ``enc``: the :func:`encoder` of ``tokenizer``
    where the caller has one (a copy costs ~10 ms).
    """
    enc = encoder(tokenizer) if enc is None else enc
    if type(enc.pre_tokenizer).__name__ != "BertPreTokenizer":
        return []
    sep_id, unk_id = tokenizer.sep_token_id, tokenizer.unk_token_id
    added = set(tokenizer.get_added_vocab())
    probes = list(zip(_MARKER_PROBES, _MARKER_PROBES[1:] + _MARKER_PROBES[:1], strict=True))
    alone = {e: enc.encode(e, add_special_tokens=False).ids for e in _MARKER_PROBES}
    with_sep = [[*alone[a], sep_id, *alone[b], sep_id] for a, b in probes]  # the [SEP] form
    found, unknown = [], []
    for char in _INLINE_MARKER_CANDIDATES:
        ids = enc.encode(char, add_special_tokens=False).ids
        if len(ids) != 1 or ids[0] == sep_id or char in added:
            continue
        mid = ids[0]
        inline = enc.encode_batch([char.join(s) + char for s in probes], add_special_tokens=False)
        if all(
            [mid if i == sep_id else i for i in a] == b.ids for a, b in zip(with_sep, inline, strict=True)
        ):
            (unknown if mid == unk_id else found).append((char, mid))
    return found + unknown


def save_tokenizer(tokenizer: Any, path: Path) -> None:
    """Save so that ``AutoTokenizer.from_pretrained(path)`` gives the same vocabulary back."""
    tokenizer.save_pretrained(str(path))
