"""Tokenizer: trained WordPiece round-trips through AutoTokenizer at full size; vocab rounding; loading."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from bert_mp.data.tokenizer import (
    SPECIAL_TOKENS,
    count_special_token_texts,
    encoder,
    inline_markers,
    load_tokenizer,
    round_vocab_size,
    save_tokenizer,
    special_token_texts,
    train_wordpiece,
)
from bert_mp.errors import DataError

TEXTS = [
    f"The {w} module provides {v} functions for Working with {w} objects. Running, runner, runs."
    for w in ("socket", "email", "json", "pathlib", "asyncio", "decimal", "unicodedata", "collections")
    for v in ("helper", "utility", "conversion", "parsing")
] * 5


@pytest.fixture(scope="module")
def trained():
    return train_wordpiece(iter(TEXTS), vocab_size=300, lowercase=True)


_TRAIN_IN_A_FRESH_PROCESS = """
import hashlib, itertools, json, sys
from bert_mp.data.builtin_corpus import builtin_documents
from bert_mp.data.tokenizer import train_wordpiece
texts = [d["text"] for d in itertools.islice(builtin_documents(), 60)]
tok = train_wordpiece(lambda: iter(texts), vocab_size=1000)
ids = tok("Return the binary representation of an integer, tokenized.")["input_ids"]
print(hashlib.sha256(json.dumps([sorted(tok.get_vocab().items()), ids]).encode()).hexdigest())
"""


def test_training_gives_the_same_vocabulary_in_every_process():
    """huggingface/tokenizers#1794: the stock WordPieceTrainer learned 4 different vocabularies in 4
    processes on these 60 documents (vocabulary 1000); each process has its own hash seeds."""
    import subprocess
    import sys

    digests = {
        subprocess.run(
            [sys.executable, "-c", _TRAIN_IN_A_FRESH_PROCESS],
            capture_output=True,
            text=True,
            check=True,
            env={**__import__("os").environ, "PYTHONHASHSEED": str(seed)},
        ).stdout.strip()
        for seed in (1, 2, 3)
    }
    assert len(digests) == 1 and len(next(iter(digests))) == 64, digests


def test_only_berts_special_tokens_are_special(trained):
    """The ``##c`` tokens registered for training are ordinary word pieces of the result."""
    assert sorted(trained.all_special_tokens) == sorted(SPECIAL_TOKENS)
    backend = trained.backend_tokenizer
    assert sorted(t.content for t in backend.get_added_tokens_decoder().values()) == sorted(SPECIAL_TOKENS)
    assert trained.tokenize("the ##e") == ["the", "[UNK]", "[UNK]", "e"]  # text, not a token "##e"
    pieces = trained.tokenize("runners")
    assert len(pieces) > 1 and all(p.startswith("##") for p in pieces[1:])
    ids = trained("conversion runners")["input_ids"]
    assert trained.decode(ids, skip_special_tokens=True) == "conversion runners"


def test_round_vocab_size():
    assert round_vocab_size(30522) == 30528
    assert round_vocab_size(64) == 64
    assert round_vocab_size(65) == 128
    assert round_vocab_size(1) == 64


def test_trained_tokenizer_saves_and_reloads_at_full_size(trained, tmp_path):
    size = len(trained)
    assert 100 < size <= 300  # the real trained vocabulary, not a 5-token shell
    assert trained.convert_ids_to_tokens(list(range(5))) == SPECIAL_TOKENS
    save_tokenizer(trained, tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert len(loaded) == size
    assert loaded.get_vocab() == trained.get_vocab()
    text = "The JSON module provides parsing functions."
    assert loaded(text)["input_ids"] == trained(text)["input_ids"]
    enc = loaded("first part", "second part")
    assert enc["input_ids"][0] == loaded.cls_token_id and enc["input_ids"][-1] == loaded.sep_token_id
    assert set(enc["token_type_ids"]) == {0, 1}
    assert loaded.tokenize("Running") == ["running"]  # lowercased
    assert any(t.startswith("##") for t in loaded.get_vocab())  # real word pieces


def test_cased_option_keeps_case():
    cased = train_wordpiece(iter(TEXTS), vocab_size=300, lowercase=False)
    assert cased.tokenize("Working")[0].startswith("W")


def test_encoder_adds_no_specials_and_never_truncates(trained):
    trained.backend_tokenizer.enable_truncation(8)
    enc = encoder(trained)
    long = " ".join(["json"] * 50)
    assert len(enc.encode_batch_fast([long], add_special_tokens=False)[0].ids) == 50
    trained.backend_tokenizer.no_truncation()


def test_load_tokenizer_checks(trained, tmp_path):
    save_tokenizer(trained, tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"), max_seq_length=128)
    assert len(tok) == len(trained)
    with pytest.raises(DataError, match="cannot load"):
        load_tokenizer(str(tmp_path / "missing"))
    trained.model_max_length = 64
    save_tokenizer(trained, tmp_path / "short")
    with pytest.raises(DataError, match="exceeds the tokenizer's model_max_length=64"):
        load_tokenizer(str(tmp_path / "short"), max_seq_length=128)


def test_inline_markers_only_where_proven():
    """The fast sentence markers: punctuation tokens of a BERT pre-tokenizer, in candidate order;
    none ([SEP] only) where no candidate is in the vocabulary or the pre-tokenizer differs."""
    from tokenizers import pre_tokenizers

    with_pipe = train_wordpiece(iter([t + " a|b ~ #1" for t in TEXTS]), vocab_size=300)
    found = [(c, m) for c, m in inline_markers(with_pipe) if m != with_pipe.unk_token_id]
    assert [c for c, _ in found] == ["|", "~", "#"]
    assert [with_pipe.convert_ids_to_tokens(m) for _, m in found] == ["|", "~", "#"]
    # No candidate character in the vocabulary: each marks as [UNK] (a document with an [UNK] word
    # then takes the [SEP] form: test_prepare.py::test_unknown_markers_give_the_same_rows_as_sep).
    plain = train_wordpiece(iter(TEXTS), vocab_size=300)
    assert {m for _, m in inline_markers(plain)} == {plain.unk_token_id}
    assert [c for c, _ in inline_markers(with_pipe)][3:5] == ["^", "`"]  # [UNK] ones after the known
    # A pre-tokenizer that does not isolate punctuation: never.
    with_pipe.backend_tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    assert inline_markers(with_pipe) == []


def test_encoder_tokenizes_special_tokens_written_in_the_text_as_text(trained):
    """A [SEP] or [MASK] in a corpus is text: it encodes as the lowercase words would, never to a
    special id (the saved tokenizer itself still finds specials, as transformers expects)."""
    enc = encoder(trained)
    specials = set(trained.all_special_ids) - {trained.unk_token_id}  # "[" is not in this vocabulary
    text = "the json [SEP] module [MASK] runs [CLS] and [PAD] [UNK]"
    ids = enc.encode_batch_fast([text], add_special_tokens=False)[0].ids
    assert not specials & set(ids)
    assert ids == enc.encode(text.lower(), add_special_tokens=False).ids
    assert trained.sep_token_id in trained(text, add_special_tokens=False)["input_ids"]
    assert special_token_texts(enc) == SPECIAL_TOKENS


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.lists(st.sampled_from([*"[]SEPMAKCLé日 x", "[SEP]", "[MASK]"]), max_size=20).map("".join)),
    st.integers(1, 5),
    st.integers(0, 3),
)
def test_counting_special_token_texts_in_arrow_strings(texts, chunk, skip):
    """The vectorized count equals str.count per string, in any chunking or slice, and never
    counts a match across two strings ("[SE" + "P]")."""
    import pyarrow as pa

    want = {s: n for s in SPECIAL_TOKENS if (n := sum(t.count(s) for t in texts))}
    padded = ["[S"] * skip + texts
    arr = pa.chunked_array(
        [pa.array(padded[i : i + chunk], pa.string()) for i in range(0, len(padded), chunk)]
        or [pa.array([], pa.string())]
    )
    assert count_special_token_texts(arr.slice(skip), SPECIAL_TOKENS) == want
    assert count_special_token_texts(pa.array(texts, pa.large_string()), SPECIAL_TOKENS) == want
    assert count_special_token_texts(pa.array(["a [SE", "P] b", "[SEP]"]), SPECIAL_TOKENS) == {"[SEP]": 1}
