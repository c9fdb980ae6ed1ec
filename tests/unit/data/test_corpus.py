"""Corpus readers: document boundaries, formats, globs, the Hub path with a local dataset, bad input."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import read_documents as _read

from bert_mp.data import corpus
from bert_mp.data.corpus import resolve_paths
from bert_mp.errors import DataError


def test_text_blank_lines_separate_documents_with_any_line_endings(tmp_path):
    (tmp_path / "a.txt").write_bytes(
        b"doc one line1\r\nline2\r\n\r\n  \r\ndoc two\rstill two\r\rdoc three\n\n\n\n"
    )
    docs, stats = _read(source="text", paths=[str(tmp_path / "a.txt")])
    assert docs == ["doc one line1\nline2", "doc two\nstill two", "doc three"]
    assert stats.files == 1 and stats.documents_read == 3


def test_text_documents_survive_read_chunk_boundaries(tmp_path, monkeypatch):
    text = "\n\n".join(f"document {i} é sentence. Another ü one." for i in range(300))
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    monkeypatch.setattr(corpus, "_READ_CHUNK", 7)  # splits multi-byte characters and blank lines
    docs, _ = _read(source="text", paths=[str(tmp_path / "a.txt")])
    assert docs == text.split("\n\n")


def test_oversize_document_is_cut(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "MAX_DOCUMENT_CHARS", 1000)
    monkeypatch.setattr(corpus, "_READ_CHUNK", 256)
    (tmp_path / "a.txt").write_text("word " * 2000, encoding="utf-8")  # 10k chars, no line break
    docs, stats = _read(source="text", paths=[str(tmp_path / "a.txt")])
    assert stats.split_oversize >= 9 and all(len(d) <= 1000 for d in docs)
    assert "".join(docs) == "word " * 2000


def test_invalid_utf8_is_counted_or_an_error(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"good text\n\nbad \xff\xfe bytes \xc3 here\n")
    docs, stats = _read(source="text", paths=[str(tmp_path / "bad.txt")])
    assert docs[1].count("\ufffd") == 3 and stats.invalid_utf8_replaced == 3
    with pytest.raises(DataError, match=r"bad\.txt.*invalid UTF-8.*encoding_errors=replace"):
        _read(source="text", paths=[str(tmp_path / "bad.txt")], encoding_errors="strict")


def test_globs_folders_and_missing_files(tmp_path):
    for name in ("b.txt", "a.txt", "sub/c.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(name, encoding="utf-8")
    assert [p.name for p in resolve_paths([str(tmp_path / "*.txt")])] == ["a.txt", "b.txt"]
    assert [p.name for p in resolve_paths([str(tmp_path / "**/*.txt"), str(tmp_path / "a.txt")])] == [
        "a.txt",
        "b.txt",
        "c.txt",
    ]
    assert len(resolve_paths([str(tmp_path)])) == 3
    with pytest.raises(DataError, match="file not found"):
        resolve_paths([str(tmp_path / "nope.txt")])
    with pytest.raises(DataError, match="no file matches"):
        resolve_paths([str(tmp_path / "*.md")])


def test_jsonl_counts_bad_records_and_names_the_line(tmp_path):
    lines = ['{"text": "one"}', "", '{"text": 5}', "not json", '{"other": "x"}', '["a"]', '{"text": "two"}']
    (tmp_path / "c.jsonl").write_text("\n".join(lines), encoding="utf-8")
    docs, stats = _read(source="jsonl", paths=[str(tmp_path / "c.jsonl")])
    assert docs == ["one", "two"]
    assert stats.records_without_text == 3 and stats.invalid_json_lines == 1
    assert stats.first_problem.endswith("c.jsonl:3: no string field 'text'")


def test_csv_and_parquet_text_column(tmp_path):
    (tmp_path / "d.csv").write_text('id,body\n1,"first, with comma"\n2,"multi\nline"\n', encoding="utf-8")
    docs, _ = _read(source="csv", paths=[str(tmp_path / "d.csv")], text_column="body")
    assert docs == ["first, with comma", "multi\nline"]
    with pytest.raises(DataError, match=r"no column 'text' \(columns: id, body\)"):
        _read(source="csv", paths=[str(tmp_path / "d.csv")])
    pq.write_table(pa.table({"body": ["p1", None, "p2"]}), tmp_path / "e.parquet")
    docs, stats = _read(source="parquet", paths=[str(tmp_path / "e.parquet")], text_column="body")
    assert docs == ["p1", "p2"] and stats.records_without_text == 1
    (tmp_path / "f.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="not a Parquet file"):
        _read(source="parquet", paths=[str(tmp_path / "f.parquet")])


@pytest.mark.parametrize("streaming", [False, True])
def test_hub_path_with_a_local_dataset_folder(tmp_path, streaming):
    folder = tmp_path / "my_dataset"
    folder.mkdir()
    rows = [{"content": f"document {i}. It has two sentences."} for i in range(7)]
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    docs, _ = _read(source="hub", hub_name=str(folder), text_column="content", streaming=streaming)
    assert docs == [r["content"] for r in rows]
    with pytest.raises(DataError, match="no column 'text'"):
        _read(source="hub", hub_name=str(folder), streaming=streaming)


def test_hub_unknown_dataset_is_one_line_error():
    with pytest.raises(DataError, match="cannot load Hub dataset 'no-such-user/no-such-dataset'") as e:
        _read(source="hub", hub_name="no-such-user/no-such-dataset")
    assert "\n" not in str(e.value)


def test_empty_documents_dropped_and_max_documents(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in ["a", " ", "", "b", "c"]))
    docs, stats = _read(source="jsonl", paths=[str(tmp_path / "a.jsonl")])
    assert docs == ["a", "b", "c"] and stats.dropped_empty == 2 and stats.documents_kept == 3
    docs, stats = _read(source="jsonl", paths=[str(tmp_path / "a.jsonl")], max_documents=4)
    assert docs == ["a", "b"] and stats.documents_read == 4


def test_builtin_source_yields_real_prose():
    docs, stats = _read(max_documents=5)
    assert len(docs) == 5 and all(d.strip() for d in docs) and sum(map(len, docs)) > 1000


def test_check_corpus_names_a_missing_path_unless_the_data_is_prepared(tmp_path):
    """What `bert-mp train` checks before its start-up work: the corpus, where a build would read it."""
    from bert_mp.core.config import DataConfig
    from bert_mp.data.prepare.cache import MARKER, cache_path, check_corpus

    data = DataConfig(source="text", paths=[str(tmp_path / "nope.txt")], cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match="data.paths: file not found: .*nope.txt"):
        check_corpus(data)
    folder = cache_path(data)
    folder.mkdir(parents=True)
    (folder / MARKER).write_text("done\n")
    check_corpus(data)  # prepared already: training reads the folder, not the corpus
    check_corpus(DataConfig(source="builtin", cache_dir=str(tmp_path / "c")))
