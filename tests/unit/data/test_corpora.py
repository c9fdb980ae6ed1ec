"""Corpora as people bring them: what a document is (blank_line / file / line), MLM-only packing,
duplicate documents and files, binary files, and the masking budget."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
from support import FIXED_WORDS as WORDS
from support import read_documents as _read

from bert_mp.core.config import DataConfig, load_config
from bert_mp.data import prepare as prep
from bert_mp.data.corpus import looks_binary
from bert_mp.errors import ConfigError


def _sentence(rng: random.Random, lo: int = 3, hi: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "."


def write_books(folder: Path, n_files: int = 6, seed: int = 0) -> Path:
    """Book-like files: stanzas of short lines and short prose paragraphs, blank-line separated."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(n_files):
        paras = []
        for k in range(60):
            if k % 2:
                paras.append("\n".join(_sentence(rng, 3, 6) for _ in range(4)))
            else:
                paras.append(" ".join(_sentence(rng) for _ in range(rng.randint(1, 2))))
        (folder / f"book-{f}.txt").write_text("\n\n".join(paras) + "\n", encoding="utf-8")
    return folder


def _prepare(tmp: Path, tokenizer: Path, paths: list[Path], *extra: str) -> Path:
    cfg = load_config(
        None,
        [
            "data.source=text",
            f"data.paths=[{','.join(map(str, paths))}]",
            f"data.tokenizer={tokenizer}",
            "data.max_seq_length=64",
            "data.validation_fraction=0.1",
            "data.pairing_block_chars=6000",
            f"data.cache_dir={tmp / 'cache'}",
            *extra,
        ],
    )
    return prep.prepare(cfg)


def _stats(path: Path) -> dict:
    return json.loads((path / "stats.json").read_text())


# ---- reading ---------------------------------------------------------------------------------------
def test_documents_file_reads_each_file_as_one_document(tmp_path):
    (tmp_path / "a.txt").write_text("Para one.\n\nPara two.\r\n\r\nPara three.\n")
    (tmp_path / "b.txt").write_text("Only one.")
    docs, _ = _read(source="text", paths=[str(tmp_path)], documents="file")
    assert docs == ["Para one.\n\nPara two.\n\nPara three.\n", "Only one."]
    docs, _ = _read(source="text", paths=[str(tmp_path)])
    assert len(docs) == 4


def test_binary_files_are_skipped_and_counted_with_the_first_path(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "a.txt").write_text("Real text. More text.")
    (tmp_path / "b.bin").write_bytes(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    (tmp_path / "c.txt").write_bytes("utf-16 text".encode("utf-16"))
    docs, stats = _read(source="text", paths=[str(tmp_path)])
    assert docs == ["Real text. More text."]
    assert stats.binary_files == 2 and stats.first_binary_file.endswith("b.bin")
    assert stats.invalid_utf8_replaced == 0


def test_looks_binary_spares_text_in_other_encodings():
    assert not looks_binary("Café crème, naïve. ".encode("latin-1") * 40)
    assert not looks_binary("日本語の文。".encode() * 100)
    assert not looks_binary(b"tabs\tand\fform feeds\r\n" * 30)
    assert not looks_binary(b"")
    assert looks_binary(b"text\x00more")
    assert looks_binary(bytes(range(1, 32)) * 20)


def test_a_file_reached_twice_is_read_once_and_counted(tmp_path):
    (tmp_path / "a.txt").write_text("One document. Two sentences.")
    os.symlink(tmp_path / "a.txt", tmp_path / "link.txt")
    docs, stats = _read(source="text", paths=[str(tmp_path), str(tmp_path / "a.txt")])
    assert docs == ["One document. Two sentences."]
    assert stats.duplicate_paths == 2 and "link.txt" in stats.first_duplicate_path


# ---- config ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides,key",
    [
        (["data.documents=paragraph"], "data.documents"),
        (["data.objective=rtd"], "data.objective"),
        (["data.source=jsonl", "data.paths=[x.jsonl]", "data.documents=file"], "data.documents"),
        (
            ["data.source=text", "data.paths=[x]", "data.documents=line", "data.sentence_splitter=nltk"],
            "data.sentence_splitter",
        ),
        (["data.objective=mlm", "data.dupe_factor=2"], "data.dupe_factor"),
        (["data.max_predictions_per_seq=0"], "data.max_predictions_per_seq"),
    ],
)
def test_new_keys_are_validated_with_a_one_line_error_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(key) and "\n" not in str(e.value)


def test_masking_budget_follows_max_seq_length_and_warns_below_it():
    assert DataConfig().max_predictions() == 20  # ceil(0.15 * 128)
    assert DataConfig(max_seq_length=512).max_predictions() == 77
    assert DataConfig(max_seq_length=40).max_predictions() == 6
    assert DataConfig(max_seq_length=512).masking_cap_warning() is None
    warning = DataConfig(max_seq_length=512, max_predictions_per_seq=20).masking_cap_warning()
    assert "below the 77" in warning and "3.9%" in warning
    # an explicit cap equal to the derived one is the same data
    assert DataConfig(max_predictions_per_seq=20).cache_key() == DataConfig().cache_key()


def test_collator_warns_about_a_low_cap():
    from support import make_tokenizer

    from bert_mp.data.masking import PretrainingCollator

    with pytest.warns(UserWarning, match="max_predictions_per_seq=5 is below"):
        PretrainingCollator(
            make_tokenizer(), DataConfig(max_seq_length=256, max_predictions_per_seq=5), seed=0
        )


# ---- prepare: document modes -----------------------------------------------------------------------
def test_line_documents_take_lines_as_sentences(tmp_path, tokenizer_dir):
    rng = random.Random(1)
    docs = []
    for _ in range(40):
        # lines that the rule splitter would cut ("Dr. X. Y.") or join (lower-case starts)
        lines = [
            " ".join(_sentence(rng) for _ in range(3)) if i % 2 else _sentence(rng).lower() for i in range(5)
        ]
        docs.append("\n".join(lines))
    corpus = tmp_path / "google.txt"
    corpus.write_text("\n\n".join(docs) + "\n")
    s = _stats(_prepare(tmp_path, tokenizer_dir, [corpus], "data.documents=line"))
    sentences = sum(v["sentences"] for v in s["per_split"].values())
    assert s["documents"]["documents_kept"] == 40 and sentences == 40 * 5
    blank = _stats(_prepare(tmp_path, tokenizer_dir, [corpus]))
    assert sum(v["sentences"] for v in blank["per_split"].values()) != sentences


def test_books_as_files_pack_examples_close_to_full_length(tmp_path, tokenizer_dir):
    books = write_books(tmp_path / "books")
    paths = sorted(books.glob("*.txt"))
    paragraphs = _stats(_prepare(tmp_path, tokenizer_dir, paths))["per_split"]["train"]
    files = _prepare(tmp_path, tokenizer_dir, paths, "data.documents=file")
    train = _stats(files)["per_split"]["train"]
    assert paragraphs["padding_fraction_at_max_seq_length"] > 0.3
    # whole books: chunks fill up to the target length (short_seq_prob aside)
    assert (
        train["padding_fraction_at_max_seq_length"] < 0.15 < paragraphs["padding_fraction_at_max_seq_length"]
    )
    assert train["mean_length"] > paragraphs["mean_length"] and train["documents"] <= len(paths)
    assert sum(train["length_histogram"].values()) == train["examples"]


# ---- prepare: objective=mlm ------------------------------------------------------------------------
def test_mlm_objective_packs_full_length_rows_without_nsp_labels(tmp_path, tokenizer_dir):
    books = write_books(tmp_path / "books", n_files=4)
    paths = sorted(books.glob("*.txt"))
    path = _prepare(tmp_path / "one", tokenizer_dir, paths, "data.objective=mlm")
    data = prep.load_prepared(path)
    train = data.dataset["train"]
    assert train.column_names == ["input_ids", "token_type_ids"]
    tok = data.tokenizer
    rows = train["input_ids"]
    assert all(r[0] == tok.cls_token_id and r[-1] == tok.sep_token_id for r in rows)
    lengths = [len(r) for r in rows]
    full = sum(n == 64 for n in lengths)
    assert full >= len(rows) - data.stats["per_split"]["train"]["blocks"]  # one short tail per block
    assert all(set(t) == {0} for t in train["token_type_ids"])
    st = data.stats
    assert st["objective"] == "mlm" and st["nsp_random_share"] is None
    tr = st["per_split"]["train"]
    assert tr["nsp"] is None and tr["padding_fraction_at_max_seq_length"] < 0.05
    assert tr["document_separators"] > 0 and sum(tr["length_histogram"].values()) == tr["examples"]
    # every token of the text is in the rows exactly once: tokens + separators + 2 per row
    assert tr["example_tokens"] == tr["tokens"] + tr["document_separators"] + 2 * tr["examples"]

    # the same rows for any num_proc, and static masking works on packed rows
    two = _prepare(tmp_path / "two", tokenizer_dir, paths, "data.objective=mlm", "data.num_proc=2")
    for split in ("train", "validation"):
        assert prep.load_prepared(two).dataset[split].data.table.equals(data.dataset[split].data.table)
    static = prep.load_prepared(
        _prepare(tmp_path, tokenizer_dir, paths, "data.objective=mlm", "data.masking=static")
    )
    m = static.stats["per_split"]["train"]["masking"]
    assert m["masked_share_of_candidates"] == pytest.approx(0.15, abs=0.01)
    assert static.dataset["train"].column_names == ["input_ids", "token_type_ids", "labels"]


def test_collator_and_model_without_nsp_labels():
    import torch
    from support import make_tokenizer
    from transformers import BertConfig, BertForPreTraining

    from bert_mp.data.masking import PretrainingCollator
    from bert_mp.model.bert import PretrainingModel

    tok = make_tokenizer()
    collator = PretrainingCollator(tok, DataConfig(max_seq_length=32), seed=0)
    feats = [
        {"input_ids": [2, *range(5, 25), 3], "token_type_ids": [0] * 22, "index": i, "epoch": 0}
        for i in range(4)
    ]
    batch = collator(feats)
    assert "next_sentence_label" not in batch
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    model = PretrainingModel(BertForPreTraining(cfg))
    out = model(**batch)
    assert out["nsp_count"].item() == 0 and out["nsp_loss_sum"].item() == 0.0 and out["mlm_count"].item() > 0
    (out["mlm_loss_sum"] + out["nsp_loss_sum"]).backward()
    # the NSP head stays in the graph (DDP sees it used) with a zero gradient
    assert torch.count_nonzero(model.model.cls.seq_relationship.weight.grad) == 0


# ---- prepare: duplicates ---------------------------------------------------------------------------
def test_dedupe_removes_exact_duplicate_documents_and_counts_them(tmp_path, tokenizer_dir):
    rng = random.Random(2)
    unique = [" ".join(_sentence(rng) for _ in range(4)) for _ in range(30)]
    text = "\n\n".join(unique + unique[:10] + ["  " + unique[3] + "  "]) + "\n"
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.txt").write_text("\n\n".join(unique[20:]) + "\n")
    paths = [tmp_path / "a.txt", tmp_path / "b.txt"]
    kept = _stats(_prepare(tmp_path, tokenizer_dir, paths, "data.dedupe=true"))
    assert kept["documents"]["duplicate_documents"] == 21 and kept["documents"]["documents_kept"] == 30
    assert sum(v["documents"] for v in kept["per_split"].values()) == 30
    plain = _stats(_prepare(tmp_path, tokenizer_dir, paths))
    assert plain["documents"]["duplicate_documents"] == 0 and plain["documents"]["documents_kept"] == 51
    two = _prepare(tmp_path / "two", tokenizer_dir, paths, "data.dedupe=true", "data.num_proc=2")
    assert _stats(two)["splits"] == kept["splits"]
