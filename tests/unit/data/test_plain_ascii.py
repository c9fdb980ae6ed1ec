"""Plain-ASCII documents take a faster copy of the tokenizer (``tokenizer.plain_ascii_encoder``): the same
ids as the tokenizer's own on every plain-ASCII text, found per document (``arrow_text.plain_ascii``),
and the same prepared rows as without it."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import LEXICON, SPECIALS, wordpiece_tokenizer
from tokenizers import normalizers

from bert_mp.core.config import load_config
from bert_mp.data import prepare as prep
from bert_mp.data.arrow_text import plain_ascii
from bert_mp.data.prepare import blocks as prep_blocks
from bert_mp.data.tokenizer import _INLINE_MARKER_CANDIDATES, encoder, plain_ascii_encoder

PLAIN = string.printable[:-2] + "\r"  # printable ASCII, tab, line feed, carriage return
assert set(PLAIN) == {chr(c) for c in range(0x20, 0x7F)} | {"\t", "\n", "\r"}
NOT_PLAIN = "\x00\x0b\x0c\x1f\x7f\x80\u00e9\u00b6\u20ac\u65e5\ufffd\U0001f600"


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.text(alphabet=st.sampled_from(PLAIN + NOT_PLAIN), max_size=10), max_size=10),
    st.integers(0, 10),
    st.booleans(),
)
def test_plain_ascii_is_a_per_character_check_on_any_array(texts, cut, large):
    expect = [all(c in PLAIN for c in t) for t in texts]
    arr = pa.array(texts, pa.large_string() if large else pa.string())
    assert plain_ascii(arr).tolist() == expect
    assert plain_ascii(pa.chunked_array([arr.slice(0, cut), arr.slice(cut)], arr.type)).tolist() == expect
    assert plain_ascii(arr.slice(1)).tolist() == expect[1:]  # an array that starts at an offset


def _vocab() -> list[str]:
    words = sorted(set(LEXICON) | {w.capitalize() for w in LEXICON} | {"##s", "##ing", "##ed"})
    return SPECIALS + words + list(string.punctuation + string.digits)


def _bert_text(lowercase: bool = True):
    tok = wordpiece_tokenizer(_vocab(), bert_text=True)
    tok.backend_tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    return tok


_PIECES = st.one_of(
    st.sampled_from(LEXICON),
    st.sampled_from(LEXICON).map(str.capitalize),
    st.sampled_from(LEXICON).map(str.upper),
    st.sampled_from([*SPECIALS, "[sep]", "[SEP", "##s"]),  # special tokens' texts are text here
    st.sampled_from([c for c in _INLINE_MARKER_CANDIDATES if c.isascii()]),
    st.text(alphabet=st.sampled_from(PLAIN), max_size=6),
)
_GAPS = st.sampled_from(["", " ", "  ", "\t", "\n", "\r\n", " \n\n "])


@pytest.mark.parametrize("lowercase", [True, False], ids=["uncased", "cased"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_the_plain_ascii_encoder_gives_the_tokenizers_own_ids(lowercase, data):
    tok = _bert_text(lowercase)
    enc = encoder(tok)
    fast = plain_ascii_encoder(enc)
    assert fast is not None and fast.encode_special_tokens
    pieces = data.draw(st.lists(st.tuples(_PIECES, _GAPS), max_size=30))
    text = "".join(p + g for p, g in pieces)
    assert plain_ascii(pa.array([text]))[0]
    assert fast.encode(text, add_special_tokens=False).ids == enc.encode(text, add_special_tokens=False).ids
    batch = [text, text.upper(), text.lower()]
    assert [e.ids for e in fast.encode_batch_fast(batch, add_special_tokens=False)] == [
        e.ids for e in enc.encode_batch_fast(batch, add_special_tokens=False)
    ]


def test_the_unproven_tokenizers_have_no_plain_ascii_encoder():
    assert plain_ascii_encoder(encoder(_bert_text())) is not None
    whitespace = wordpiece_tokenizer(_vocab())  # another pre-tokenizer
    assert plain_ascii_encoder(encoder(whitespace)) is None
    nfkc = _bert_text()
    nfkc.backend_tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    assert plain_ascii_encoder(encoder(nfkc)) is None
    added = _bert_text()
    added.add_tokens(["module test"])  # an added token that is not special: matched on normalized text
    assert plain_ascii_encoder(encoder(added)) is None


def _mixed_corpus(path: Path) -> Path:
    """Documents of plain ASCII and documents that are not (accents, CJK, a euro sign, control
    characters), some holding marker characters."""
    rng = random.Random(5)
    spice = ["caf\u00e9", "\u65e5\u672c", "\u20ac5", "a\x0bb", "del\x7f", "x|y", "%", "\u00b6"]
    docs = []
    for d in range(90):
        sents = []
        for _ in range(rng.randint(1, 7)):
            words = [rng.choice(LEXICON + (spice if d % 3 == 0 else [])) for _ in range(rng.randint(2, 12))]
            sents.append(" ".join(words).capitalize() + rng.choice([".", "!", "?"]))
        docs.append(rng.choice([" ", "\n", "\t"]).join(sents))
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("objective", ["nsp", "mlm"])
def test_prepare_gives_the_same_rows_with_and_without_the_plain_ascii_encoder(
    tmp_path, monkeypatch, objective
):
    corpus = _mixed_corpus(tmp_path / "corpus.txt")
    tok = tmp_path / "tok"
    _bert_text().save_pretrained(tok)

    def cfg(name: str):
        return load_config(
            None,
            [
                "data.source=text",
                f"data.paths=[{corpus}]",
                f"data.tokenizer={tok}",
                f"data.objective={objective}",
                "data.max_seq_length=48",
                "data.masking=static",
                "data.pairing_block_chars=3000",
                f"data.cache_dir={tmp_path / name}",
            ],
        )

    seen: dict[str, int] = {"plain": 0, "other": 0}
    encode_with = prep_blocks.BlockPairer._encode_with

    def counted(self, enc, texts, cuts=None):
        seen["plain" if enc is self.ascii_encoder else "other"] += len(texts)
        return encode_with(enc, texts, cuts)

    monkeypatch.setattr(prep_blocks.BlockPairer, "_encode_with", counted)
    fast = prep.load_prepared(prep.prepare(cfg("fast"))).dataset
    assert seen["plain"] > 0 and seen["other"] > 0  # both kinds of document in the blocks
    seen_plain = seen["plain"]  # stats.json counts them (those not redone in the [SEP] form)
    monkeypatch.setattr(prep_blocks, "plain_ascii_encoder", lambda enc: None)
    seen.update(plain=0, other=0)
    stock = prep.load_prepared(prep.prepare(cfg("stock"))).dataset
    assert seen["plain"] == 0
    assert fast["train"].num_rows > 20
    counted = {}
    for name in ("fast", "stock"):
        stats = json.loads(next((tmp_path / name).glob("*/stats.json")).read_text())
        counted[name] = [stats["per_split"][s]["plain_ascii_documents"] for s in ("train", "validation")]
    assert counted["stock"] == [0, 0] and 0 < sum(counted["fast"]) <= seen_plain
    for split in fast:
        assert fast[split].data.table.equals(stock[split].data.table), split
