"""`bert-mp prepare` on tiny corpora, in this process: layout, statistics, determinism across num_proc,
cache keying and atomicity, static masking, and bad input through the CLI entry point (a hostile
corpus through the real CLI: integration/test_prepare_cli.py)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
from support import LEXICON as WORDS
from support import SPECIALS, wordpiece_tokenizer, write_corpus
from transformers import AutoTokenizer

from bert_mp.cli import main
from bert_mp.core.config import load_config
from bert_mp.data import prepare as prep
from bert_mp.data.masking import PretrainingCollator
from bert_mp.data.prepare import blocks as prep_blocks
from bert_mp.data.prepare import build as prep_build
from bert_mp.data.prepare import pool as prep_pool
from bert_mp.data.prepare import read as prep_read
from bert_mp.data.prepare import vocab as prep_vocab
from bert_mp.data.tokenizer import _INLINE_MARKER_CANDIDATES, inline_markers
from bert_mp.errors import DataError


def _cfg(tmp_path: Path, corpus: Path, *extra: str):
    return load_config(
        None,
        [
            "data.source=text",
            f"data.paths=[{corpus}]",
            "data.vocab_size=200",
            "data.max_seq_length=48",
            "data.validation_fraction=0.1",
            f"data.cache_dir={tmp_path / 'cache'}",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("prepared")
    return prep.load_prepared(prep.prepare(_cfg(tmp, corpus)))


def test_output_layout_columns_and_tokenizer(prepared):
    p = prepared.path
    for name in ("dataset", "tokenizer", "config.yaml", "stats.json", "PREPARED"):
        assert (p / name).exists(), name
    assert p.name == load_config(p / "config.yaml").data.cache_key()
    assert set(prepared.dataset) == {"train", "validation"}
    assert prepared.dataset["train"].column_names == ["input_ids", "token_type_ids", "next_sentence_label"]
    tok = AutoTokenizer.from_pretrained(str(p / "tokenizer"))
    assert len(tok) == prepared.stats["tokenizer_size"] > 100
    assert prepared.stats["model_vocab_size"] % 64 == 0
    assert prepared.stats["model_vocab_size"] - 64 < len(tok) <= prepared.stats["model_vocab_size"]


def test_every_example_fits_and_has_one_boundary(prepared):
    cls, sep = prepared.tokenizer.cls_token_id, prepared.tokenizer.sep_token_id
    for split in ("train", "validation"):
        ds = prepared.dataset[split]
        assert len(ds) > 0
        for ex in ds:
            ids, tt = ex["input_ids"], ex["token_type_ids"]
            assert len(ids) <= 48 and len(ids) == len(tt)
            assert ids[0] == cls and ids[-1] == sep and ids.count(sep) == 2
            first_sep = ids.index(sep)
            assert tt == [0] * (first_sep + 1) + [1] * (len(ids) - first_sep - 1)
            assert first_sep >= 2 and len(ids) - first_sep >= 3  # A and B are non-empty


def test_stats_are_consistent_with_the_data(prepared):
    s, ds = prepared.stats, prepared.dataset["train"]
    labels = np.array(ds["next_sentence_label"])
    train = s["per_split"]["train"]
    assert s["splits"] == {"train": len(ds), "validation": len(prepared.dataset["validation"])}
    assert train["nsp"]["random_next"] == labels.sum()
    assert 0.45 <= s["nsp_random_share"] <= 0.55
    assert sum(train["length_histogram"].values()) == len(ds)
    lengths = np.array([len(x) for x in ds["input_ids"]])
    assert train["padding_fraction_at_max_seq_length"] == pytest.approx(1 - lengths.mean() / 48)
    d = s["documents"]
    assert d["documents_read"] == d["documents_kept"] == 150
    assert train["documents"] + s["per_split"]["validation"]["documents"] == 150
    assert s["tokens"] > 0 and s["tokens_per_sec"] > 0
    assert set(s["seconds"]) >= {"read", "tokenizer", "split_tokenize_pair", "write", "total"}


def test_collator_masks_prepared_examples(prepared):
    cfg = load_config(prepared.path / "config.yaml")
    collate = PretrainingCollator(prepared.tokenizer, cfg.data, seed=1)
    feats = [dict(prepared.dataset["train"][i], index=i, epoch=0) for i in range(16)]
    batch = collate(feats)
    assert ((batch["labels"] != -100).sum(1) >= 1).all()
    assert (batch["labels"][batch["input_ids"] == prepared.tokenizer.cls_token_id] == -100).all()


def _rows(path: Path) -> dict:
    data = prep.load_prepared(path).dataset
    return {split: data[split].data.table for split in data}


def test_num_proc_does_not_change_a_byte(tmp_path, corpus, prepared):
    # A fixed tokenizer: WordPiece *training* itself is not reproducible run to run (hash-map order
    # in the Rust trainer, huggingface/tokenizers#1794); everything after it must be.
    extra = (
        "data.pairing_block_chars=3000",
        "data.masking=static",
        "data.dupe_factor=2",
        f"data.tokenizer={prepared.path / 'tokenizer'}",
    )
    one = prep.prepare(_cfg(tmp_path / "one", corpus, *extra, "data.num_proc=1"))
    four = prep.prepare(_cfg(tmp_path / "four", corpus, *extra, "data.num_proc=4"))
    stats = json.loads((one / "stats.json").read_text())
    assert stats["per_split"]["train"]["blocks"] >= 8  # many blocks, spread over the 4 workers
    a, b = _rows(one), _rows(four)
    assert a["train"].num_rows > 100
    for split in a:
        assert a[split].equals(b[split]), split
    assert (
        json.loads((four / "stats.json").read_text())["per_split"]["train"]["examples"] == a["train"].num_rows
    )


@pytest.mark.parametrize("objective", ["nsp", "mlm"])
def test_blocks_encoded_in_pieces_give_the_same_bytes(tmp_path, monkeypatch, corpus, prepared, objective):
    """One large block (the default block size on a small corpus) for two workers: it is encoded
    in pieces by both workers and paired once they are back; the rows and counts are those of one
    process, which encodes the block whole."""
    cut = []
    real = prep_pool._work_units

    def spy(*args):
        units = real(*args)
        cut.extend(u for u in units if u[2] is not None)
        return units

    monkeypatch.setattr(prep_pool, "_work_units", spy)
    extra = (
        f"data.objective={objective}",
        "data.masking=static",
        f"data.dupe_factor={2 if objective == 'nsp' else 1}",
        f"data.tokenizer={prepared.path / 'tokenizer'}",
    )
    one = prep.prepare(_cfg(tmp_path / "one", corpus, *extra, "data.num_proc=1"))
    assert not cut  # one process: no pool, nothing cut
    two = prep.prepare(_cfg(tmp_path / "two", corpus, *extra, "data.num_proc=2"))
    st1, st2 = (json.loads((p / "stats.json").read_text()) for p in (one, two))
    assert st1["per_split"]["train"]["blocks"] == 1 and len(cut) >= 4
    a, b = _rows(one), _rows(two)
    for split in a:
        assert a[split].num_rows > 0 and a[split].equals(b[split]), split
    for split in ("train", "validation"):  # the pieces' counts summed into the block's
        s1, s2 = (dict(st["per_split"][split]) for st in (st1, st2))
        assert set(s1.pop("cpu_seconds")) == set(s2.pop("cpu_seconds"))
        assert s1 == s2


@pytest.mark.parametrize("seed", range(12))
def test_work_units_cut_only_large_blocks_into_whole_documents(seed):
    rng = np.random.default_rng(seed)
    n_blocks = int(rng.integers(1, 12))
    sizes = rng.integers(1, 40, size=n_blocks)
    chars = rng.integers(1, 5000, size=int(sizes.sum())) if seed % 3 else np.full(int(sizes.sum()), 100)
    ids = np.split(np.arange(int(sizes.sum())), np.cumsum(sizes)[:-1])
    blocks = {0: ids[:-1], 1: ids[-1:]} if n_blocks > 1 else {0: ids, 1: []}
    keys = [(s, b) for s in (0, 1) for b in range(len(blocks[s]))]
    costs = [int(chars[blocks[s][b]].sum()) for s, b in keys]
    num_proc = int(rng.integers(2, 5))
    units = prep_pool._work_units(blocks, keys, costs, num_proc, chars)
    assert [u[0] for u in units] == sorted((u[0] for u in units), reverse=True)  # longest first
    target = sum(costs) / (prep_pool._PIECES_PER_WORKER * num_proc)
    for key, cost in zip(keys, costs, strict=True):
        mine = sorted((u for u in units if u[1] == key), key=lambda u: u[2] or 0)
        if mine[0][2] is None:  # whole: small enough, a single document, or one that holds nearly all
            docs = blocks[key[0]][key[1]]
            assert len(mine) == 1 and (cost <= target or len(docs) == 1 or chars[docs].max() * 2 > cost)
            continue
        assert cost > target and [u[2] for u in mine] == list(range(len(mine))) and len(mine) >= 2
        assert np.array_equal(np.concatenate([u[3] for u in mine]), blocks[key[0]][key[1]])
        assert sum(u[0] for u in mine) == cost and all(len(u[3]) for u in mine)
    # a tiny document before a huge one: no cut leaves two pieces, so the block stays whole
    lopsided = prep_pool._work_units({0: [np.array([0, 1])], 1: []}, [(0, 0)], [1001], 2, np.array([1, 1000]))
    assert [u[2] for u in lopsided] == [None]
    many = [np.arange(i * 10, i * 10 + 10) for i in range(40)]  # 40 equal blocks for 2 workers
    even = np.full(400, 50)
    whole = prep_pool._work_units({0: many, 1: []}, [(0, b) for b in range(40)], [500] * 40, 2, even)
    assert all(u[2] is None for u in whole)


def test_static_masking_statistics(tmp_path, corpus):
    path = prep.prepare(_cfg(tmp_path, corpus, "data.masking=static", "data.dupe_factor=3"))
    pd = prep.load_prepared(path)
    m = pd.stats["per_split"]["train"]["masking"]
    assert m["masked_share_of_candidates"] == pytest.approx(0.15, abs=0.01)
    assert m["as_mask_token"] == pytest.approx(0.8, abs=0.03)
    assert m["as_random_token"] == pytest.approx(0.1, abs=0.03)
    special = set(pd.tokenizer.all_special_ids) - {pd.tokenizer.mask_token_id}
    for ex in pd.dataset["train"]:
        labels = np.array(ex["labels"])
        ids = np.array(ex["input_ids"])
        assert (labels != -100).sum() >= 1
        assert not np.isin(labels[labels != -100], list(special)).any()
        assert np.isin(ids[[0, -1]], [pd.tokenizer.cls_token_id, pd.tokenizer.sep_token_id]).all()


def test_cache_reuse_force_and_key(tmp_path, corpus, monkeypatch, capsys):
    cfg = _cfg(tmp_path, corpus)
    path = prep.prepare(cfg)

    def boom(*a, **k):
        raise AssertionError("rebuilt although a complete cache exists")

    with monkeypatch.context() as m:
        m.setattr(prep_build, "_build", boom)
        assert prep.prepare(cfg) == path
    assert "reusing" in capsys.readouterr().out
    other = _cfg(tmp_path, corpus, "data.seed=7")
    assert other.data.cache_key() != cfg.data.cache_key()
    assert _cfg(tmp_path, corpus, "data.num_proc=3").data.cache_key() == cfg.data.cache_key()
    (path / "PREPARED").write_text("old\n")
    assert prep.prepare(cfg, force=True) == path
    assert (path / "PREPARED").read_text() != "old\n"  # really rebuilt
    assert not list(path.parent.glob(".tmp-*")) and not list(path.parent.glob(".old-*"))


def test_crash_leaves_no_cache_and_partial_folder_is_never_used(tmp_path, corpus, monkeypatch):
    cfg = _cfg(tmp_path, corpus)
    final = prep.cache_path(cfg.data)

    def crash(*a, **k):
        raise RuntimeError("disk full")

    with monkeypatch.context() as m:
        m.setattr(prep_vocab, "save_tokenizer", crash)
        m.setattr(prep_build, "save_tokenizer", crash)
        with pytest.raises(RuntimeError, match="disk full"):
            prep.prepare(cfg)
    assert not final.exists() and not list(final.parent.glob(".tmp-*"))
    final.mkdir(parents=True)  # a half-written folder from some other crash
    (final / "stats.json").write_text("{}")
    with pytest.raises(DataError, match="incomplete"):
        prep.load_prepared(final)
    assert prep.is_complete(prep.prepare(cfg))


def test_one_document_corpus_is_reported(tmp_path):
    corpus = write_corpus(tmp_path / "one.txt", n_docs=1, max_sents=60)
    path = prep.prepare(_cfg(tmp_path, corpus, "data.validation_fraction=0"))
    s = json.loads((path / "stats.json").read_text())
    nsp = s["per_split"]["train"]["nsp"]
    assert nsp["random_next"] == 0 and nsp["no_other_document"] + nsp["skipped_single_segment"] > 0
    assert any("single document" in w for w in s["warnings"])
    assert s["splits"]["validation"] == 0


def test_a_split_without_examples_is_empty_with_worker_processes(tmp_path, corpus, prepared):
    """data.num_proc > 1 and no validation documents: the validation split is an empty dataset with
    the examples' columns, as with one process."""
    tok = f"data.tokenizer={prepared.path / 'tokenizer'}"
    for n in (1, 2):
        path = prep.prepare(
            _cfg(
                tmp_path / str(n),
                corpus,
                tok,
                "data.validation_fraction=0",
                "data.pairing_block_chars=2000",
                f"data.num_proc={n}",
            )
        )
        pd = prep.load_prepared(path)
        assert len(pd.dataset["validation"]) == 0 and len(pd.dataset["train"]) > 0
        assert pd.dataset["validation"].column_names == pd.dataset["train"].column_names


def test_single_sentence_single_document_is_an_error(tmp_path):
    (tmp_path / "c.txt").write_text("Just one sentence here.\n")
    with pytest.raises(DataError, match="no training pairs"):
        prep.prepare(_cfg(tmp_path, tmp_path / "c.txt", "data.validation_fraction=0"))


def _main(tmp_path, monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """The CLI entry point in this process (faster than a subprocess; same code path)."""
    monkeypatch.chdir(tmp_path)
    rc = main(["prepare", *args, f"data.cache_dir={tmp_path / 'cache'}"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_bad_input_gives_one_line_errors(tmp_path, monkeypatch, capsys):
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 au lait. Second sentence.\n\nOther doc here. And more.\n")
    cases = [
        (["data.source=text", "data.paths=[missing.txt]"], "file not found: missing.txt"),
        (["data.source=text", "data.paths=[empty.txt]"], "no usable documents"),
        (["data.source=text", "data.paths=[bad.txt]", "data.encoding_errors=strict"], "invalid UTF-8"),
        (["data.max_seq_length=600"], "data.max_seq_length: must be between 8 and 512"),
    ]
    for args, message in cases:
        rc, _, err = _main(tmp_path, monkeypatch, capsys, *args)
        assert rc == 2, (args, err[-2000:])
        last = err.strip().splitlines()[-1]
        assert message in last and last.startswith("bert-mp prepare: error:"), err[-2000:]
        assert "Traceback" not in err


def test_cli_jsonl_with_missing_text_fields(tmp_path, monkeypatch, capsys):
    rows = [{"text": "Alpha beta gamma. Delta epsilon zeta. Eta theta iota."}] * 20 + [
        {"body": "x"},
        {"text": 3},
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    args = ("data.source=jsonl", "data.paths=[d.jsonl]", "data.vocab_size=100", "data.max_seq_length=16")
    rc, out, err = _main(tmp_path, monkeypatch, capsys, *args)
    assert rc == 0, err[-3000:]
    assert "records without text" in out and "d.jsonl:21" in out
    rc, _, err = _main(tmp_path, monkeypatch, capsys, *args, "data.text_column=nope")
    assert rc == 2 and "without a string 'nope'" in err and "d.jsonl:1" in err


def test_trained_tokenizer_is_shared_by_configs_on_the_same_corpus(tmp_path, corpus):
    a = prep.load_prepared(prep.prepare(_cfg(tmp_path, corpus)))
    b = prep.load_prepared(
        prep.prepare(_cfg(tmp_path, corpus, "data.masking=static", "data.max_seq_length=40"))
    )
    assert a.path != b.path
    assert a.tokenizer.get_vocab() == b.tokenizer.get_vocab()
    c = prep.load_prepared(prep.prepare(_cfg(tmp_path, corpus, "data.vocab_size=150")))
    assert len(c.tokenizer) < len(a.tokenizer)


def test_pretrained_tokenizer_by_path(tmp_path, prepared, corpus):
    cfg = _cfg(tmp_path, corpus, f"data.tokenizer={prepared.path / 'tokenizer'}")
    pd = prep.load_prepared(prep.prepare(cfg))
    assert pd.stats["tokenizer_size"] == prepared.stats["tokenizer_size"]
    assert pd.stats["tokenizer"] == str(prepared.path / "tokenizer")


def test_cli_config_error_is_one_line(capsys):
    assert main(["prepare", "data.masking=sometimes"]) == 2
    assert "data.masking" in capsys.readouterr().err


@pytest.mark.parametrize("streaming", [False, True])
def test_hub_path_gives_the_same_rows_as_the_local_path(tmp_path, corpus, prepared, streaming):
    """The same documents through source=hub (a local dataset folder, streamed or not) and through
    source=jsonl prepare byte-identical rows (same tokenizer, so WordPiece training is out of it)."""
    docs = [d for d in corpus.read_text(encoding="utf-8").split("\n\n") if d.strip()]
    folder = tmp_path / "hub_dataset"
    folder.mkdir()
    (folder / "train.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs), encoding="utf-8")
    common = [f"data.tokenizer={prepared.path / 'tokenizer'}", "data.masking=static"]
    local = _cfg(tmp_path, corpus, "data.source=jsonl", f"data.paths=[{folder / 'train.jsonl'}]", *common)
    hub = _cfg(
        tmp_path, corpus, "data.source=hub", f"data.hub_name={folder}", f"data.streaming={streaming}", *common
    )
    a = prep.load_prepared(prep.prepare(local)).dataset
    b = prep.load_prepared(prep.prepare(hub)).dataset
    for split in ("train", "validation"):
        assert len(a[split]) > 0
        assert a[split].data.table.equals(b[split].data.table), split


def _marker_corpus(path: Path) -> Path:
    """Documents with varied text; some contain inline marker characters, a few all of them."""
    rng = random.Random(3)
    extra = [
        "caf\u00e9",
        "\u00fcber",
        "\u65e5\u672c",
        "x|y",
        "a \u00b6 b",
        "(3.5%)",
        '"quoted"',
        "e.g.",
        "|\u00b6%",
    ]
    docs = []
    for d in range(120):
        sents = []
        for _ in range(rng.randint(1, 8)):
            words = [rng.choice(WORDS + (extra if d % 3 == 0 else [])) for _ in range(rng.randint(2, 14))]
            sents.append(" ".join(words).capitalize() + rng.choice([".", "!", "?"]))
        docs.append(" ".join(sents))
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


def _known_markers(tokenizer) -> list[tuple[str, int]]:
    """The inline markers of regular tokens only (none of [UNK])."""
    return [(c, m) for c, m in inline_markers(tokenizer) if m != tokenizer.unk_token_id]


def test_inline_markers_give_the_same_rows_as_sep(tmp_path, monkeypatch):
    """Each document takes the first candidate marker it does not contain, [SEP] if it contains
    them all; the rows are those of marking every document with [SEP]. (Regular tokens only here;
    the [UNK] markers: test_unknown_markers_give_the_same_rows_as_sep.)"""
    corpus = _marker_corpus(tmp_path / "corpus.txt")
    base = prep.prepare(_cfg(tmp_path / "tok", corpus))
    tok = f"data.tokenizer={base / 'tokenizer'}"
    tokenizer = AutoTokenizer.from_pretrained(base / "tokenizer")
    markers = [c for c, _ in _known_markers(tokenizer)]
    assert markers == ["|", "%", "\u00b6"]  # the candidates in this corpus's vocabulary, in order
    unknown = [c for c, m in inline_markers(tokenizer) if m == tokenizer.unk_token_id]
    assert unknown == [c for c in _INLINE_MARKER_CANDIDATES if c not in markers]  # then the others, as [UNK]
    monkeypatch.setattr(prep_blocks, "inline_markers", lambda t, *_: _known_markers(t))
    extra = (tok, "data.masking=static", "data.pairing_block_chars=2000", "data.validation_fraction=0")
    inline = prep.prepare(_cfg(tmp_path / "inline", corpus, *extra))
    train = json.loads((inline / "stats.json").read_text())["per_split"]["train"]
    docs = [d for d in corpus.read_text(encoding="utf-8").split("\n\n") if d.strip()]
    with_all = sum(all(c in d for c in markers) for d in docs)
    assert 0 < with_all < sum("|" in d for d in docs)  # some take a later candidate, some [SEP]
    assert train["documents"] == len(docs)
    assert train["sep_marked_documents"] == with_all
    monkeypatch.setattr(prep_blocks, "inline_markers", lambda *_: [])
    sep = prep.prepare(_cfg(tmp_path / "sep", corpus, *extra))
    assert json.loads((sep / "stats.json").read_text())["per_split"]["train"]["sep_marked_documents"] == len(
        docs
    )
    a, b = _rows(inline), _rows(sep)
    assert a["train"].num_rows > 50
    for split in a:
        assert a[split].equals(b[split]), split


def test_inline_marker_count_check_falls_back_to_sep(tmp_path, monkeypatch):
    """A marker that does not come back once per boundary (here: an id that never appears, as with a
    normalizer that rewrites the character) is caught per document and redone with [SEP]."""
    corpus = _marker_corpus(tmp_path / "corpus.txt")
    base = prep.prepare(_cfg(tmp_path / "tok", corpus))
    extra = (f"data.tokenizer={base / 'tokenizer'}", "data.pairing_block_chars=2000")
    good = prep.prepare(_cfg(tmp_path / "good", corpus, *extra))
    tokenizer = AutoTokenizer.from_pretrained(base / "tokenizer")
    wrong_id = tokenizer.mask_token_id  # never in the output
    right = _known_markers(tokenizer)
    # the first candidate's id is wrong, the others right: only documents holding "|" keep an inline marker
    monkeypatch.setattr(prep_blocks, "inline_markers", lambda *_: [("|", wrong_id), *right[1:]])
    redone = prep.prepare(_cfg(tmp_path / "redone", corpus, *extra))
    stats = json.loads((redone / "stats.json").read_text())["per_split"]
    docs = [d for d in corpus.read_text(encoding="utf-8").split("\n\n") if d.strip()]
    assert sum(s["sep_marked_documents"] for s in stats.values()) == sum(
        "|" not in d or all(c in d for c, _ in right) for d in docs
    )
    a, b = _rows(good), _rows(redone)
    for split in a:
        assert a[split].equals(b[split]), split


def test_unknown_markers_give_the_same_rows_as_sep(tmp_path, monkeypatch):
    """A vocabulary holding no candidate character (a corpus without them): the candidates mark
    sentences as [UNK]; a document holding a word that is [UNK] itself (a candidate character
    included) takes the [SEP] form, counted; the rows are those of marking every document with [SEP]."""
    tokens = [*SPECIALS, *WORDS, *".!?"]
    wordpiece_tokenizer(tokens, bert_text=True).save_pretrained(str(tmp_path / "tok"))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tok")
    found = inline_markers(tokenizer)
    assert [c for c, _ in found] == list(_INLINE_MARKER_CANDIDATES)
    assert {m for _, m in found} == {tokenizer.unk_token_id}
    text = write_corpus(tmp_path / "corpus.txt", n_docs=80, seed=4).read_text(encoding="utf-8")
    docs = text.strip().split("\n\n")
    w = WORDS
    docs[::7] = [f"{d} {w[0]} zzyzx {w[1]}." for d in docs[::7]]  # an [UNK] word: the [SEP] form
    docs[3::7] = [f"{d} {w[4]} | {w[5]}." for d in docs[3::7]]  # a candidate, itself [UNK]: the same
    (tmp_path / "corpus.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    extra = (
        f"data.tokenizer={tmp_path / 'tok'}",
        "data.pairing_block_chars=3000",
        "data.validation_fraction=0",
    )
    inline = prep.prepare(_cfg(tmp_path / "inline", tmp_path / "corpus.txt", *extra))
    train = json.loads((inline / "stats.json").read_text())["per_split"]["train"]
    assert train["sep_marked_documents"] == len(docs[::7]) + len(docs[3::7]) < len(docs) / 3
    monkeypatch.setattr(prep_blocks, "inline_markers", lambda *_: [])
    sep = prep.prepare(_cfg(tmp_path / "sep", tmp_path / "corpus.txt", *extra))
    a, b = _rows(inline), _rows(sep)
    assert a["train"].num_rows > 50 and a["train"].equals(b["train"])


def test_take_texts_reads_a_window_of_a_chunked_column():
    import pyarrow as pa

    texts = [f"doc {i} " + "x" * (i % 7) for i in range(1000)]
    table = pa.Table.from_batches(
        [pa.RecordBatch.from_pydict({"text": texts[lo : lo + 64]}) for lo in range(0, 1000, 64)]
    )
    assert table.column("text").num_chunks > 10
    for ids in ([5], [63, 64, 65], list(range(200, 400, 3)), [0, 999], []):
        assert prep.take_texts(table, ids) == [texts[i] for i in ids]
    assert prep.take_texts(table, np.array([70, 71, 130])) == [texts[70], texts[71], texts[130]]


def _multi_file_corpus(folder: Path) -> Path:
    folder.mkdir()
    for i in range(5):
        write_corpus(folder / f"part-{i}.txt", n_docs=30, seed=10 + i)
    (folder / "part-5-empty.txt").write_text("")
    (folder / "part-6-latin1.txt").write_bytes(
        "Caf\xe9 cr\xe8me. Na\xefve text.\r\n\r\nTwo. Yes.".encode("latin-1")
    )
    return folder


def test_parallel_read_gives_the_same_documents_rows_and_counts(tmp_path, prepared, monkeypatch):
    groups = []
    original = prep_read._file_groups

    def spy(paths, jobs):
        groups.append(original(paths, jobs))
        return groups[-1]

    monkeypatch.setattr(prep_read, "_file_groups", spy)
    monkeypatch.setattr(prep_read, "_READER_BYTES", 1)  # parallel reading on a tiny corpus
    folder = _multi_file_corpus(tmp_path / "many")
    extra = (f"data.tokenizer={prepared.path / 'tokenizer'}", "data.pairing_block_chars=3000")
    one = prep.prepare(_cfg(tmp_path / "one", folder, *extra, "data.num_proc=1"))
    three = prep.prepare(_cfg(tmp_path / "three", folder, *extra, "data.num_proc=3"))
    # only the second run read in parallel: three contiguous runs of files, all files once, in order
    assert len(groups) == 1 and len(groups[0]) == 3
    assert [f for g in groups[0] for f in g] == [str(p) for p in sorted(folder.iterdir())]
    a, b = _rows(one), _rows(three)
    for split in a:
        assert a[split].num_rows > 0 and a[split].equals(b[split]), split
    sa, sb = (json.loads((p / "stats.json").read_text())["documents"] for p in (one, three))
    assert sa == sb
    assert sa["files"] == 7 and sa["files_empty"] == [str(folder / "part-5-empty.txt")]
    assert sa["invalid_utf8_replaced"] == 3 and sa["documents_kept"] == 152


def test_parallel_read_error_names_the_file(tmp_path, prepared):
    folder = _multi_file_corpus(tmp_path / "many")
    cfg = _cfg(
        tmp_path,
        folder,
        f"data.tokenizer={prepared.path / 'tokenizer'}",
        "data.encoding_errors=strict",
        "data.num_proc=2",
    )
    with pytest.raises(DataError, match=r"part-6-latin1\.txt.*invalid UTF-8"):
        prep.prepare(cfg)
    assert not any((tmp_path / "cache").glob(".tmp-*"))  # nothing half-built left behind


@pytest.mark.skipif(
    __import__("multiprocessing").get_start_method() != "fork", reason="the patch reaches forked readers only"
)
def test_a_reader_process_that_dies_ends_prepare_with_a_data_error(tmp_path, monkeypatch, prepared):
    real = prep_read.arrow_stream

    def stream(path, schema):  # the first reader dies as it opens its output (forked: inherited)
        if Path(path).name == "part-00000.arrow":
            os._exit(9)  # what the out-of-memory killer leaves: no exception, no result
        return real(path, schema)

    monkeypatch.setattr(prep_read, "arrow_stream", stream)
    monkeypatch.setattr(prep_read, "_READER_BYTES", 1)  # parallel reading on a tiny corpus
    folder = _multi_file_corpus(tmp_path / "many")
    cfg = _cfg(tmp_path, folder, f"data.tokenizer={prepared.path / 'tokenizer'}", "data.num_proc=2")
    with pytest.raises(
        DataError, match="a reader process ended abruptly.*data.num_proc=1 reads in this process"
    ):
        prep.prepare(cfg)
    assert not any((tmp_path / "cache").glob(".tmp-*"))  # nothing half-built left behind


def _pooled_cfg(tmp_path, corpus, prepared):
    """Small blocks through a pool of two pairing workers, with a fixed tokenizer."""
    return _cfg(
        tmp_path,
        corpus,
        f"data.tokenizer={prepared.path / 'tokenizer'}",
        "data.pairing_block_chars=3000",
        "data.num_proc=2",
    )


def _failing_block(monkeypatch, how):
    """Block 1 of the training split fails in the pairing worker that takes it (forked: the patch
    is inherited)."""
    real = prep_blocks.BlockPairer.__call__

    def call(self, split, block, doc_ids, parts=None):
        if (split, block) == (0, 1):
            if how == "raise":
                raise DataError("block 1 is broken")
            os._exit(9)  # what the out-of-memory killer leaves: no exception, no result
        return real(self, split, block, doc_ids, parts)

    monkeypatch.setattr(prep_blocks.BlockPairer, "__call__", call)


@pytest.mark.parametrize("how", ["raise", "die"])
def test_a_pairing_worker_that_fails_ends_prepare_with_its_error_and_leaves_nothing(
    tmp_path, monkeypatch, corpus, prepared, how
):
    _failing_block(monkeypatch, how)
    cfg = _pooled_cfg(tmp_path, corpus, prepared)
    expected = "block 1 is broken" if how == "raise" else "a pairing worker process ended abruptly"
    with pytest.raises(DataError, match=expected):
        prep.prepare(cfg)
    assert list((tmp_path / "cache").iterdir()) in ([], [tmp_path / "cache" / "tokenizers"])


def test_pairing_pool_hands_out_the_longest_blocks_first(tmp_path, monkeypatch, corpus, prepared):
    """The pool's jobs are costed by their characters and handed to the workers longest first (the
    rest follow as workers finish), so a long block never starts last. Checked where the order is
    decided, in this process: the jobs' costs are the blocks' characters and go down, and the
    executor is given them in that order (which worker process starts first is the scheduler's)."""
    from concurrent.futures import process as futures_process

    units: list = []
    real_units = prep_pool._work_units

    def work_units(*args, **kw):
        units.extend(real_units(*args, **kw))
        return units

    submitted: list = []
    real_submit = futures_process.ProcessPoolExecutor.submit

    def submit(self, fn, /, *args, **kw):
        submitted.append((fn.__name__, tuple(args[:2])))
        return real_submit(self, fn, *args, **kw)

    monkeypatch.setattr(prep_pool, "_work_units", work_units)
    monkeypatch.setattr(futures_process.ProcessPoolExecutor, "submit", submit)
    prep.prepare(_pooled_cfg(tmp_path, corpus, prepared))
    costs = [u[0] for u in units]
    assert len(units) >= 6 and len(set(costs)) > 2
    assert costs == sorted(costs, reverse=True)
    first = [("_pair_job" if u[2] is None else "_tokens_job", u[1]) for u in units]
    assert submitted[: len(units)] == first  # handed out in that order, before any later pairing job


@pytest.mark.parametrize("seed", range(20))
def test_blocks_are_contiguous_equal_and_never_a_lone_tail(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3000))
    chars = rng.integers(1, 5000, size=n) if seed % 4 else rng.integers(1, 900_000, size=n)
    block_chars = int(rng.choice([20_000, 200_000, 2_000_000]))
    blocks = prep.make_blocks(np.arange(n) + 7, chars, block_chars)
    assert np.array_equal(np.concatenate(blocks), np.arange(n) + 7)  # every document once, in order
    sizes = np.array([chars[b - 7].sum() for b in blocks])
    total = int(chars.sum())
    assert len(blocks) <= max(1, round(total / block_chars))
    target = total // max(1, round(total / block_chars))
    assert (sizes[:-1] >= target).all() and (sizes[:-1] < target + chars.max()).all()
    if len(blocks) > 1:
        # a short tail, or a one-document one, joins the block before (a document that alone
        # holds a block's characters is a block, wherever it is)
        assert sizes[-1] >= target // 2 and (len(blocks[-1]) > 1 or sizes[-1] >= target)


def test_blocks_share_the_characters_out_evenly():
    # 5,300 documents of 2,400 characters at 2 M per block: six blocks of ~2.12 M, where cutting
    # at 2 M left five of 2 M and a sixth of 2.72 M (one worker of two then ends 0.7 M behind)
    sizes = [int(b.size) * 2400 for b in prep.make_blocks(np.arange(5300), np.full(5300, 2400), 2_000_000)]
    assert len(sizes) == 6 and max(sizes) - min(sizes) <= 2 * 2400 * 4
    # ten ~1.3 M documents: no block is left with one document (no random B there)
    assert all(b.size >= 2 for b in prep.make_blocks(np.arange(9), np.full(9, 1_300_000), 2_000_000))


def test_file_groups_are_contiguous_and_balanced_by_bytes(tmp_path):
    sizes = [100, 100, 100, 100, 1000, 50, 50, 500]
    paths = []
    for i, n in enumerate(sizes):
        paths.append(tmp_path / f"f{i}")
        paths[-1].write_bytes(b"x" * n)
    for jobs in (1, 2, 3, 8, 20):
        groups = prep_read._file_groups(paths, jobs)
        assert [f for g in groups for f in g] == [str(p) for p in paths]
        assert 1 <= len(groups) <= min(jobs, len(paths)) and all(groups)
    two = prep_read._file_groups(paths, 2)
    assert [len(g) for g in two] == [5, 3]  # 1400 bytes then 600: the cut after the big file


def test_prepared_marker_differs_from_a_checkpoints_and_the_old_name_is_still_read(tmp_path):
    from bert_mp.core.checkpoint import store as ckpt
    from bert_mp.data.prepare import cache

    assert cache.MARKER != ckpt.MARKER  # a build stamp is not a verified manifest
    assert not cache.is_complete(tmp_path)
    (tmp_path / "COMPLETE").write_text("2026-01-01T00:00:00Z\n")  # a cache built under the old name
    assert cache.is_complete(tmp_path)
