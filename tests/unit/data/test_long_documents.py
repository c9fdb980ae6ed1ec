"""A long document is marked and encoded in bounded pieces, with the ids of the whole (memory is the
benchmark's: scripts/bench/prepare.py --shapes builtin one-line)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pyarrow as pa
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from bert_mp.core.config import DataConfig
from bert_mp.data.builtin_corpus import builtin_documents
from bert_mp.data.prepare import blocks
from bert_mp.data.segment import cut_into_pieces, mark_documents, mark_rule_in_pieces
from bert_mp.data.tokenizer import WHITESPACE_CUTS, encoder, piece_cuts, train_wordpiece


@pytest.fixture(scope="module")
def tokenizer():
    texts = [d["text"] for d in itertools.islice(builtin_documents(), 300)]
    return train_wordpiece(texts, 600)


def _long_text(chars: int, seed: int = 0) -> str:
    """Prose of the built-in corpus run into one line, with what the rules look at: abbreviations,
    quotes, blank lines, non-ASCII letters, CJK, a special token's text and long runs of letters."""
    rng = random.Random(seed)
    words = " ".join(d["text"] for d in itertools.islice(builtin_documents(), 200)).split()
    extra = ["Dr. Smith", "e.g. this.", '"Quoted." She', "U.S. Army.", "\n\n  Next.", "café naïve",
             "日本語の文。", "[SEP]", "[MASK].", "x" * 300, "a,b;c", "(A) B?"]  # fmt: skip
    out, n = [], 0
    while n < chars:
        w = rng.choice(extra) if rng.random() < 0.02 else rng.choice(words)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def test_pieces_join_back_and_cut_only_before_a_cut_character():
    text = _long_text(50_000)
    pieces = cut_into_pieces(text, 4000, WHITESPACE_CUTS)
    assert "".join(pieces) == text and len(pieces) > 12
    assert all(len(p) <= 4000 for p in pieces) and all(p[0] in WHITESPACE_CUTS for p in pieces[1:])
    hard = cut_into_pieces("y" * 10_000, 4000, WHITESPACE_CUTS)  # no cut character: at the size
    assert [len(p) for p in hard] == [4000, 4000, 2000]
    assert cut_into_pieces("short", 4000, WHITESPACE_CUTS) == ["short"]


def test_a_long_document_encoded_in_pieces_has_the_ids_of_the_whole(tokenizer, monkeypatch):
    enc = encoder(tokenizer)
    cuts = piece_cuts(enc)
    assert cuts is not None and "]" not in cuts and "[" in cuts  # "]" would part "[SEP]"
    text = _long_text(60_000, seed=1)
    monkeypatch.setattr(blocks, "PIECE_CHARS", 2_000)
    whole = enc.encode(text, add_special_tokens=False).ids
    short = ["A short one.", "Another, shorter."]
    got = blocks.encode_texts(enc, [short[0], text, short[1]], cuts)
    assert list(got[1]) == whole and len(whole) > 10_000
    assert got[0] == enc.encode(short[0], add_special_tokens=False).ids
    # the [SEP] form: prepare's [SEP] markers found as special tokens, never cut apart
    marked = text.replace(". ", ".[SEP]")
    enc.encode_special_tokens = False
    try:
        assert (
            list(blocks.encode_texts(enc, [marked], cuts)[0])
            == enc.encode(marked, add_special_tokens=False).ids
        )
    finally:
        enc.encode_special_tokens = True


def test_a_long_document_marked_in_pieces_is_marked_as_the_whole():
    text = _long_text(80_000, seed=2)
    (whole,), (count,) = mark_documents([text], "|")
    for size in (500, 3_000, 20_000):
        assert mark_rule_in_pieces(text, "|", size) == (whole, count)
    plain = "no boundary at all " * 500
    (marked,), (n,) = mark_documents([plain], "|")
    assert mark_rule_in_pieces(plain, "|", 300) == (marked, n) == (plain.strip() + "|", 1)


def test_a_block_with_a_long_document_gives_the_rows_of_the_whole(tokenizer, monkeypatch):
    texts = [_long_text(40_000, seed=3), "Two sentences here. And here.", _long_text(3_000, seed=4)]
    docs = type("Docs", (), {"data": type("T", (), {"table": pa.table({"text": texts})})()})()
    data = DataConfig(max_seq_length=64, masking="static")
    ids = np.arange(len(texts))
    whole = blocks.BlockPairer(docs, tokenizer, data)(0, 0, ids)
    monkeypatch.setattr(blocks, "PIECE_CHARS", 1_000)
    pairer = blocks.BlockPairer(docs, tokenizer, data)
    calls: list[int] = []
    pairer.encoder, pairer.ascii_encoder = (
        Seen(e, calls) if e else e for e in (pairer.encoder, pairer.ascii_encoder)
    )
    pieces = pairer(0, 0, ids)
    assert pieces[0].equals(whole[0]) and pieces[0].num_rows > 100
    assert 0 < max(calls) <= 1_000  # the tokenizer never saw a text over a piece


class Seen:
    """A Rust tokenizer whose ``encode_batch_fast`` calls are recorded (the longest text of each)."""

    def __init__(self, enc, calls: list[int]):
        object.__setattr__(self, "enc", enc)
        object.__setattr__(self, "calls", calls)

    def __getattr__(self, name):
        return getattr(self.enc, name)

    def __setattr__(self, name, value):
        setattr(self.enc, name, value)

    def encode_batch_fast(self, texts, **kw):
        self.calls.append(max(map(len, texts)))
        return self.enc.encode_batch_fast(texts, **kw)


def test_tokenizers_that_keep_spaces_with_words_are_encoded_whole():
    byte_level = Tokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel()
    byte_level.decoder = decoders.ByteLevel()
    assert piece_cuts(byte_level) is None
    metaspace = Tokenizer(models.Unigram())
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    assert piece_cuts(metaspace) is None
    replaced = Tokenizer(models.WordPiece({"[UNK]": 0}, unk_token="[UNK]"))
    replaced.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    replaced.normalizer = normalizers.Replace("a b", "c")  # looks across a space
    assert piece_cuts(replaced) is None
    replaced.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase()])
    assert piece_cuts(replaced) is not None
