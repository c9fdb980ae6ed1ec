"""The vocabulary's sample and alphabet (``data.vocab_sample_chars``): bounded, deterministic, drawn
across the whole corpus, the same for every ``data.shard`` share; a corpus within the sample learns
exactly the vocabulary it learned before the sample existed; the ``##c`` alphabet found in the Arrow
bytes equals the one a Python pass over every document found."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from support import read_documents, write_corpus
from tokenizers import normalizers

from bert_mp.core.config import load_config
from bert_mp.data import prepare as prep
from bert_mp.data.arrow_text import distinct_characters
from bert_mp.data.prepare.vocab import SAMPLE_STRATA, vocabulary_sample
from bert_mp.data.tokenizer import train_wordpiece

UNICODE_DOCS = [
    "Café crème, naïve façade: déjà vu. Über STRASSE und Maß.",
    "ΟΔΟΣ και οδός. Σίσυφος έλεγε: «ναι». Ἀθῆναι.",
    "İstanbul ve ılık IŞIK. Ǆemal, ǅ and ǆ.",
    "日本語の文。次の文です。中文句子，还有一句。",
    "مرحبا بالعالم. هذا نص عربي. שלום עולם, עוד משפט.",
    "e\u0301te\u0301 combining, Zero\u200dwidth joiner, tab\there, bell\x07 and NUL-free text.",
    "한국어 문장입니다. Ελληνικά ﬁ ligature ﬂow and Ⅻ roman, ½ half, ² square.",
    "Emoji 🙂 in text 👍🏽 and symbols ™ © ® § ¶ † ‡ … — – •.",
    "NBSP\u00a0inside, thin\u2009space, ideographic\u3000space. Ñandú año.",
]
"""Characters BERT's normalizer changes, removes, splits off or decomposes."""

BEFORE_THE_SAMPLE = ("0.23.3", "283bc4298aeb3e51f6b4263abce311d5be334dfb638613f02bbc844b8f57575e")
"""sha256 of the sorted vocabulary that `bert-mp prepare` learned from :func:`_corpus` before the
sample and the Arrow alphabet (the code of commit 7cf4666, tokenizers 0.23.3)."""


def _corpus(root: Path) -> Path:
    root.mkdir()
    write_corpus(root / "a.txt", n_docs=80, seed=5)
    (root / "b.txt").write_text(
        "\n\n".join(d for d in UNICODE_DOCS for _ in range(3)) + "\n", encoding="utf-8"
    )
    return root


def _vocab_digest(vocab: dict[str, int]) -> str:
    return hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()


def _cfg(tmp_path: Path, corpus: Path, *extra: str):
    return load_config(
        None,
        [
            "data.source=text",
            f"data.paths=[{corpus}]",
            "data.vocab_size=400",
            "data.max_seq_length=64",
            f"data.cache_dir={tmp_path / 'cache'}",
            *extra,
        ],
    )


def test_a_corpus_within_the_sample_learns_the_vocabulary_it_learned_before(tmp_path, capsys):
    """Every training document is the sample: the vocabulary is the one learned before the sample
    (recorded digest), and the one the old alphabet pass (normalize_str on every document) gives."""
    corpus = _corpus(tmp_path / "corpus")
    prepared = prep.load_prepared(prep.prepare(_cfg(tmp_path, corpus)))
    voc = prepared.stats["vocabulary"]
    assert (
        voc["whole"]
        and voc["documents"] == voc["of_documents"] == prepared.stats["per_split"]["train"]["documents"]
    )
    assert voc["sample_chars"] == 50_000_000 and voc["seed"] == 12345 and not voc["reused"]
    assert f"vocabulary: learned from all {voc['documents']} training documents" in capsys.readouterr().out
    vocab = prepared.tokenizer.get_vocab()
    if tokenizers.__version__ == BEFORE_THE_SAMPLE[0]:
        assert _vocab_digest(vocab) == BEFORE_THE_SAMPLE[1]
    # the old alphabet: every training document normalized in Python (normalizing again is a no-op)
    docs, _ = read_documents(source="text", paths=[str(corpus)])
    split, _ = prep.build.split_documents(
        pa.table({"text": docs}), load_config(prepared.path / "config.yaml").data
    )
    texts = [docs[i] for i in split[0]]
    norm = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=True)
    old = set().union(*(norm.normalize_str(t) for t in texts))
    assert train_wordpiece(texts, 400, characters=old).get_vocab() == vocab


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from("".join(UNICODE_DOCS) + "ab \n\t\u0301\u0308ΣσẞİI"), min_size=0, max_size=60))
def test_the_characters_normalized_alone_are_those_of_the_normalized_text(chars):
    """What the alphabet relies on: BERT's normalizer maps every character on its own."""
    text = "".join(chars)
    for lowercase in (True, False):
        norm = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=lowercase)
        alone = set().union(*(norm.normalize_str(c) for c in set(text)))
        assert alone == set(norm.normalize_str(text))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(max_size=30), max_size=12), st.integers(1, 5), st.booleans())
def test_distinct_characters_reads_every_character_of_arrow_strings(texts, chunk, large):
    arrays = [
        pa.array(texts[i : i + chunk], pa.large_string() if large else pa.string())
        for i in range(0, len(texts), chunk)
    ]
    sliced = [a.slice(1) for a in arrays]  # an array that starts inside its buffers
    assert distinct_characters(arrays) == sorted(set("".join(texts)))
    assert distinct_characters(sliced) == sorted(set("".join(t for a in arrays for t in a.to_pylist()[1:])))
    assert distinct_characters(
        [pa.chunked_array(arrays, pa.large_string() if large else pa.string())]
    ) == sorted(set("".join(texts)))


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(1, 5000), min_size=1, max_size=3000),
    st.integers(1, 200_000),
    st.integers(0, 2**32),
)
def test_the_sample_is_bounded_deterministic_and_within_the_documents(lengths, budget, seed):
    chars = np.asarray(lengths, dtype=np.int64)
    ids = np.arange(0, chars.size, 2)  # every other document trains
    got = vocabulary_sample(ids, chars, budget, seed)
    assert np.array_equal(got, vocabulary_sample(ids, chars, budget, seed))
    assert np.all(np.diff(got) > 0) and np.isin(got, ids).all()
    total = int(chars[ids].sum())
    if total <= budget:
        assert np.array_equal(got, ids)
    else:
        assert budget <= chars[got].sum() < budget + chars[ids].max()


def test_every_part_of_the_corpus_contributes_its_share():
    """100 files of 300 documents, the sample a tenth of them: every file gives ~a tenth of its
    text, not the first files all of theirs; another seed draws other documents."""
    rng = np.random.default_rng(0)
    chars = rng.integers(50, 3000, size=30_000)
    ids = np.arange(chars.size)
    budget = int(chars.sum() // 10)
    got = vocabulary_sample(ids, chars, budget, 1)
    per_file = np.bincount(got // 300, weights=chars[got], minlength=100) / np.bincount(
        ids // 300, weights=chars, minlength=100
    )
    assert per_file.min() > 0.05 and per_file.max() < 0.2, per_file
    other = vocabulary_sample(ids, chars, budget, 2)
    assert len(np.intersect1d(got, other)) < 0.3 * len(got)
    # documents longer than a stratum's share: still bounded, and spread over the corpus
    long_docs = np.full(3 * SAMPLE_STRATA, 10_000)
    few = vocabulary_sample(np.arange(long_docs.size), long_docs, 200_000, 1)
    assert 20 <= few.size <= 21 and few.min() < long_docs.size // 10 and few.max() > long_docs.size * 9 // 10
    assert np.array_equal(vocabulary_sample(ids, chars, None, 1), ids)


def test_every_share_learns_the_vocabulary_of_the_whole_corpus_sample(tmp_path, capsys):
    """No tokenizer given: data.shard=0/1, 0/2 and 1/2 learn one vocabulary from one sample of the
    whole corpus, recorded in stats.json and the summary; the sample is part of the cache key."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        write_corpus(corpus / f"{i}.txt", n_docs=40, seed=i)
    sample = ("data.vocab_sample_chars=30000", "data.dedupe=true")
    runs = {
        shard: prep.load_prepared(prep.prepare(_cfg(tmp_path, corpus, *sample, f"data.shard={shard}")))
        for shard in ("0/1", "0/2", "1/2")
    }
    out = capsys.readouterr().out
    vocabs = [r.tokenizer.get_vocab() for r in runs.values()]
    assert vocabs[0] == vocabs[1] == vocabs[2]
    shares = [runs["0/2"].path, runs["1/2"].path]
    both = prep.load_prepared_shares([str(p) for p in shares], load_config(shares[0] / "config.yaml").data)
    assert len(both.dataset["train"]) == sum(len(runs[s].dataset["train"]) for s in ("0/2", "1/2"))
    records = [r.stats["vocabulary"] for r in runs.values()]
    sample_keys = (
        "sample_chars",
        "seed",
        "whole",
        "documents",
        "of_documents",
        "characters",
        "of_characters",
    )
    assert len({tuple(v[k] for k in sample_keys) for v in records}) == 1
    voc = records[0]
    assert not voc["whole"] and 30_000 <= voc["characters"] < 32_000 and voc["seed"] == 12345
    assert voc["documents"] < voc["of_documents"] == runs["0/1"].stats["per_split"]["train"]["documents"]
    assert f"a sample of {voc['documents']} of {voc['of_documents']} training documents" in out
    assert [v["reused"] for v in records] == [False, True, True]  # one training, kept in the cache
    assert records[0]["cpu_seconds"] > 0 and "cpu_seconds" not in records[1]
    whole = prep.load_prepared(prep.prepare(_cfg(tmp_path, corpus, "data.vocab_sample_chars=null")))
    assert whole.stats["vocabulary"]["whole"] and whole.tokenizer.get_vocab() != vocabs[0]
    keys = {_cfg(tmp_path, corpus, f"data.vocab_sample_chars={n}").data.cache_key() for n in (30000, 40000)}
    given = {
        _cfg(tmp_path, corpus, f"data.vocab_sample_chars={n}", "data.tokenizer=x").data.cache_key()
        for n in (1, 2)
    }
    assert len(keys) == 2 and len(given) == 1


def test_a_bad_sample_size_is_one_line(capsys):
    from bert_mp.cli import main

    assert main(["prepare", "data.vocab_sample_chars=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.vocab_sample_chars: must be >= 1" in err[0]
