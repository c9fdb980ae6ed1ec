"""Prepared data carries a fingerprint of its bytes; checkpoints carry the one they were trained on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import tiny_config

from bert_mp.core.storage.files import atomic_write_json
from bert_mp.data import prepare as prep
from bert_mp.data.fingerprint import folder_fingerprint, same_data
from bert_mp.data.prepare import build as prep_build
from bert_mp.errors import TrainingError
from bert_mp.pretrain.trainer import train


@pytest.fixture(scope="module")
def prepared_cfg(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp")
    cfg = tiny_config(root / "run", max_steps=3, save_every=1, export=True)
    cfg.data.cache_dir, cfg.data.max_documents, cfg.data.vocab_size = str(root / "data"), 40, 300
    cfg.validate()
    path = prep.prepare(cfg)
    return cfg, path


def test_prepare_records_the_fingerprint_of_its_bytes(prepared_cfg, tmp_path):
    _, path = prepared_cfg
    stats = json.loads((path / "stats.json").read_text())
    assert stats["fingerprint"] == folder_fingerprint(path) and len(stats["fingerprint"]) == 32
    import shutil

    copy = tmp_path / "copy"
    for part in ("dataset", "tokenizer"):
        shutil.copytree(path / part, copy / part)
    assert folder_fingerprint(copy) == stats["fingerprint"]
    vocab = copy / "tokenizer" / "tokenizer.json"
    vocab.write_bytes(vocab.read_bytes().replace(b'"[MASK]"', b'"[MASQ]"', 1))
    assert folder_fingerprint(copy) != stats["fingerprint"]  # one changed token string is seen


def test_the_fingerprint_is_xxh3_128_of_each_files_path_and_bytes_in_name_order(tmp_path):
    import xxhash

    files = {"dataset/train/data-00000-of-00001.arrow": b"\x00\x01" * 5000, "dataset/b.json": b"{}",
             "tokenizer/vocab.txt": b"[PAD]\n[UNK]\n", "config.yaml": b"left out"}  # fmt: skip
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    h = xxhash.xxh3_128()
    for name in ("dataset/b.json", "dataset/train/data-00000-of-00001.arrow", "tokenizer/vocab.txt"):
        h.update(name.encode() + b"\0" + files[name])
    assert folder_fingerprint(tmp_path) == h.hexdigest()
    (tmp_path / "dataset/b.json").rename(tmp_path / "dataset/c.json")  # same bytes, another name
    assert folder_fingerprint(tmp_path) != h.hexdigest()


def test_resume_on_rebuilt_data_is_refused_naming_both_fingerprints(prepared_cfg):
    cfg, path = prepared_cfg
    summary = train(cfg)
    trained_on = summary["data"]["fingerprint"]
    assert trained_on == json.loads((path / "stats.json").read_text())["fingerprint"]
    assert trained_on in (Path(cfg.train.output_dir) / "final" / "README.md").read_text()
    # the folder is rebuilt with other bytes under the same key (prepare --force, new WordPiece ids)
    stats = json.loads((path / "stats.json").read_text())
    atomic_write_json(path / "stats.json", {**stats, "fingerprint": "0" * 32})
    cfg.train.resume, cfg.train.max_steps = "latest", 4
    try:
        with pytest.raises(TrainingError, match=f"fingerprint {trained_on}, but .* now holds {'0' * 32}"):
            train(cfg)
        cfg.train.allow_data_change = True
        assert train(cfg)["steps"] == 4
    finally:
        atomic_write_json(path / "stats.json", stats)


def test_force_rebuild_with_other_bytes_says_so(prepared_cfg, capsys, monkeypatch):
    _, path = prepared_cfg
    old = json.loads((path / "stats.json").read_text())["fingerprint"]
    prep_build._say_if_rebuilt_differently(path, path, old)
    assert capsys.readouterr().out == ""
    digests = []
    monkeypatch.setattr(prep_build, "same_data", lambda *a: digests.append(a) or same_data(*a))
    prep_build._say_if_rebuilt_differently(path, path, "f" * 32)
    assert digests[-1][-1] is False  # its stats.json names xxh3-128: no BLAKE2b pass over the folder
    out = capsys.readouterr().out
    assert f"fingerprint {old} -> {'f' * 32}" in out and "train.allow_data_change=true" in out


def test_a_fingerprint_recorded_as_blake2b_of_the_same_bytes_is_the_same_data(prepared_cfg, tmp_path, capsys):
    """Folders and checkpoints whose fingerprint is BLAKE2b-128 (same length, other digits): a run
    trained on such a folder resumes on the same bytes fingerprinted xxh3-128, and a rebuild with
    the same bytes says nothing; other bytes are still told apart."""
    cfg, path = prepared_cfg
    stats = json.loads((path / "stats.json").read_text())
    now, legacy = stats["fingerprint"], folder_fingerprint(path, blake2b=True)
    assert legacy != now and len(legacy) == len(now) == 32
    assert same_data(legacy, path, now) and same_data(now, path, now) and same_data(None, path, now)
    assert not same_data("0" * 32, path, now)
    run = tiny_config(tmp_path / "run", max_steps=3, save_every=1)
    run.data = cfg.data
    assert stats["fingerprint_hash"] == "xxh3_128"
    # a stats.json of a BLAKE2b fingerprint names no hash
    atomic_write_json(path / "stats.json", {**stats, "fingerprint": legacy, "fingerprint_hash": None})
    try:
        prep_build._say_if_rebuilt_differently(path, path, now)  # a --force build of the same bytes
        assert capsys.readouterr().out == ""
        assert train(run)["data"]["fingerprint"] == legacy  # trained on the folder as recorded then
    finally:
        atomic_write_json(path / "stats.json", stats)
    run.train.resume, run.train.max_steps = "latest", 4
    assert train(run)["steps"] == 4  # its checkpoint's BLAKE2b fingerprint is of these bytes
