"""Prepared data carries a fingerprint of its data alone and a manifest of its files; checkpoints carry
the fingerprint they were trained on; training verifies the folder before its first step."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import xxhash
from support import tiny_config

from bert_mp.core.storage.files import atomic_write_json
from bert_mp.data import prepare as prep
from bert_mp.data.fingerprint import FORM, MANIFEST, data_fingerprint, legacy_fingerprints, same_data
from bert_mp.data.prepare import build as prep_build
from bert_mp.data.prepare.cache import verify_prepared
from bert_mp.errors import DataError, TrainingError
from bert_mp.pretrain.trainer import train


def _config(root: Path):
    cfg = tiny_config(root / "run", max_steps=3, save_every=1, export=True)
    cfg.data.cache_dir, cfg.data.max_documents, cfg.data.vocab_size = str(root / "data"), 40, 300
    cfg.validate()
    return cfg


@pytest.fixture(scope="module")
def prepared_cfg(tmp_path_factory):
    cfg = _config(tmp_path_factory.mktemp("fp"))
    return cfg, prep.prepare(cfg)


def _stats(path: Path) -> dict:
    return json.loads((path / "stats.json").read_text())


def test_two_clean_prepares_in_fresh_folders_give_one_fingerprint(prepared_cfg, tmp_path):
    cfg, path = prepared_cfg
    other = _config(tmp_path)  # another cache folder (and a vocabulary learned again)
    again = prep.prepare(other)
    assert again != path and again.name == path.name
    assert _stats(again)["fingerprint"] == _stats(path)["fingerprint"] == data_fingerprint(path)
    assert _stats(path)["fingerprint_hash"] == FORM
    # datasets' own bookkeeping differs between the two: its random _fingerprint
    state = "dataset/train/state.json"
    assert (again / state).read_bytes() != (path / state).read_bytes()


def test_the_fingerprint_is_of_the_data_files_digests_and_sees_one_changed_token(prepared_cfg, tmp_path):
    _, path = prepared_cfg
    copy = tmp_path / "copy"
    for part in ("dataset", "tokenizer"):
        shutil.copytree(path / part, copy / part)
    # an independent reference: xxh3-128 over "path\0digest\n" of each data file, in path order, the
    # tokenizer config as canonical JSON without the keys that say how it was loaded
    data = sorted(
        p.relative_to(copy).as_posix()
        for p in copy.rglob("*")
        if p.is_file() and (p.suffix == ".arrow" or p.parent.name == "tokenizer")
    )
    assert data and "dataset/train/state.json" not in data

    def digest(rel: str) -> str:
        if rel.endswith("tokenizer_config.json"):
            conf = json.loads((copy / rel).read_text())
            conf = {k: v for k, v in conf.items() if k not in ("is_local", "local_files_only")}
            return xxhash.xxh3_128_hexdigest(json.dumps(conf, sort_keys=True, ensure_ascii=False).encode())
        return xxhash.xxh3_128_hexdigest((copy / rel).read_bytes())

    reference = xxhash.xxh3_128_hexdigest(b"".join(f"{rel}\0{digest(rel)}\n".encode() for rel in data))
    assert data_fingerprint(copy) == reference == _stats(path)["fingerprint"]
    # bookkeeping is not data: datasets' state, where the tokenizer was loaded from
    state = copy / "dataset" / "train" / "state.json"
    state.write_text(state.read_text().replace('"_fingerprint": "', '"_fingerprint": "0'))
    conf = copy / "tokenizer" / "tokenizer_config.json"
    conf.write_text(json.dumps({**json.loads(conf.read_text()), "is_local": False}, indent=1))
    assert data_fingerprint(copy) == reference
    # one changed token id anywhere is another fingerprint
    arrow = copy / "dataset" / "validation" / "data-00000-of-00001.arrow"
    raw = bytearray(arrow.read_bytes())
    raw[-200] ^= 1
    arrow.write_bytes(bytes(raw))
    assert data_fingerprint(copy) != reference
    raw[-200] ^= 1
    arrow.write_bytes(bytes(raw))
    vocab = copy / "tokenizer" / "tokenizer.json"
    vocab.write_bytes(vocab.read_bytes().replace(b'"[MASK]"', b'"[MASQ]"', 1))
    assert data_fingerprint(copy) != reference


def _legacy_folder(root: Path) -> dict[str, bytes]:
    files = {"dataset/train/data-00000-of-00001.arrow": b"\x00\x01" * 5000, "dataset/b.json": b"{}",
             "tokenizer/vocab.txt": b"[PAD]\n[UNK]\n", "config.yaml": b"left out"}  # fmt: skip
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def test_the_earlier_forms_of_a_folder_are_computed_in_one_pass(tmp_path):
    """Earlier forms, computed independently here: every file's path and bytes in name order,
    xxh3-128 and BLAKE2b-128; the data form over the data files' digests."""
    files = _legacy_folder(tmp_path)
    names = ("dataset/b.json", "dataset/train/data-00000-of-00001.arrow", "tokenizer/vocab.txt")
    xxh3, blake = xxhash.xxh3_128(), hashlib.blake2b(digest_size=16)
    for name in names:
        xxh3.update(name.encode() + b"\0" + files[name])
        blake.update(name.encode() + b"\0" + files[name])
    data = b"".join(f"{n}\0{xxhash.xxh3_128_hexdigest(files[n])}\n".encode() for n in names[1:])
    assert legacy_fingerprints(tmp_path) == {
        FORM: xxhash.xxh3_128_hexdigest(data),
        "xxh3_128": xxh3.hexdigest(),
        "blake2b": blake.hexdigest(),
    }
    # a folder of an earlier form: a recorded fingerprint of any form of these bytes is the same data
    for recorded in (xxh3.hexdigest(), blake.hexdigest(), xxhash.xxh3_128_hexdigest(data)):
        assert same_data(recorded, tmp_path, xxh3.hexdigest(), "xxh3_128")
    assert not same_data("0" * 32, tmp_path, xxh3.hexdigest(), "xxh3_128")
    # a folder of this form compares strings: no pass over it
    assert not same_data(blake.hexdigest(), tmp_path, "f" * 32, FORM)
    assert same_data(None, tmp_path, "f" * 32, FORM) and same_data("f" * 32, tmp_path, "f" * 32, FORM)


def test_a_folder_without_a_manifest_is_verified_against_its_recorded_fingerprint(tmp_path):
    files = _legacy_folder(tmp_path)
    blake = hashlib.blake2b(digest_size=16)
    for name in sorted(n for n in files if n != "config.yaml"):
        blake.update(name.encode() + b"\0" + files[name])
    atomic_write_json(tmp_path / "stats.json", {"fingerprint": blake.hexdigest()})
    assert "against its fingerprint" in verify_prepared(tmp_path)
    (tmp_path / "tokenizer" / "vocab.txt").write_bytes(b"[PAD]\n[UNQ]\n")
    with pytest.raises(DataError, match=f"differ from the fingerprint {blake.hexdigest()}.*no {MANIFEST}"):
        verify_prepared(tmp_path)


def test_a_changed_byte_in_an_arrow_file_is_refused_before_training_naming_the_file(prepared_cfg, tmp_path):
    cfg, path = prepared_cfg
    line = verify_prepared(path)
    assert line.startswith(f"verified {path} (") and f"against {MANIFEST}) in " in line
    arrow = path / "dataset" / "train" / "data-00000-of-00001.arrow"
    raw = arrow.read_bytes()
    arrow.write_bytes(raw[:-300] + bytes([raw[-300] ^ 0x10]) + raw[-299:])
    run = tiny_config(tmp_path / "run", max_steps=2)
    run.data = cfg.data
    try:
        with pytest.raises(DataError) as e:
            train(run)
        assert "dataset/train/data-00000-of-00001.arrow does not match its checksum" in str(e.value)
        assert "bert-mp prepare --force" in str(e.value)
        assert not (tmp_path / "run" / "checkpoints").exists()
    finally:
        arrow.write_bytes(raw)
    assert verify_prepared(path).startswith("verified")


def test_force_over_unchanged_data_says_nothing_and_the_run_resumes(prepared_cfg, capsys):
    cfg, path = prepared_cfg
    before = _stats(path)["fingerprint"]
    first = train(cfg)
    assert first["data"]["fingerprint"] == before
    assert before in (Path(cfg.train.output_dir) / "final" / "README.md").read_text()
    capsys.readouterr()
    assert prep.prepare(cfg, force=True) == path
    out = capsys.readouterr().out
    assert "rebuilt" not in out and "fingerprint" not in out
    assert _stats(path)["fingerprint"] == before
    cfg.train.resume, cfg.train.max_steps = "latest", 4
    try:
        assert train(cfg)["steps"] == 4
    finally:
        cfg.train.resume, cfg.train.max_steps = None, 3


def test_resume_on_other_data_is_refused_naming_both_fingerprints(prepared_cfg, tmp_path):
    cfg, path = prepared_cfg
    run = tiny_config(tmp_path / "run", max_steps=3, save_every=1)
    run.data = cfg.data
    trained_on = train(run)["data"]["fingerprint"]
    stats = _stats(path)
    # the folder as if rebuilt from other data (stats.json is in the manifest: remove that for the drill)
    atomic_write_json(path / "stats.json", {**stats, "fingerprint": "0" * 32})
    manifest = (path / MANIFEST).read_bytes()
    (path / MANIFEST).unlink()
    run.train.resume, run.train.max_steps = "latest", 4
    try:
        with pytest.raises(TrainingError, match=f"fingerprint {trained_on}, but .* now holds {'0' * 32}"):
            train(run)
        run.train.allow_data_change = True
        with pytest.raises(DataError, match="differ from the fingerprint 0{32}"):  # verified all the same
            train(run)
    finally:
        atomic_write_json(path / "stats.json", stats)
        (path / MANIFEST).write_bytes(manifest)


def test_force_rebuild_over_other_data_says_so(prepared_cfg, capsys, tmp_path):
    _, path = prepared_cfg
    old = _stats(path)["fingerprint"]
    prep_build._say_if_rebuilt_differently(path, old)
    assert capsys.readouterr().out == ""
    prep_build._say_if_rebuilt_differently(path, "f" * 32)
    out = capsys.readouterr().out
    assert (
        f"with other data (fingerprint {old} -> {'f' * 32})" in out and "train.allow_data_change=true" in out
    )
    # an old folder of an earlier form: fingerprinted in this form to compare (the same data: silence)
    legacy = tmp_path / "legacy"
    for part in ("dataset", "tokenizer"):
        shutil.copytree(path / part, legacy / part)
    atomic_write_json(legacy / "stats.json", {"fingerprint": legacy_fingerprints(legacy)["blake2b"]})
    prep_build._say_if_rebuilt_differently(legacy, old)
    assert capsys.readouterr().out == ""
