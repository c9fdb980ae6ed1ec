"""Writes the disk refuses (an injected ENOSPC at each write point) end in one line, leaving nothing
partial: an export folder, prepared data, the run log. Checkpoints: unit/pretrain/test_faults.py;
a real small filesystem: integration/test_full_disk.py."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
from support import load_fixture, tiny_config, write_corpus

import bert_mp.pretrain.trainer as train_mod
from bert_mp.core.config import load_config
from bert_mp.core.storage import disk as storage
from bert_mp.errors import StorageError, TrainingError


def _enospc() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_write_failures_are_found_behind_wrappers():
    wrapped = RuntimeError("worker failed")
    wrapped.__cause__ = _enospc()
    assert storage.write_failure(wrapped) is wrapped.__cause__
    torch_full = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 10880 vs 10772")
    assert storage.write_failure(torch_full) is torch_full
    assert storage.write_failure(OSError(errno.ENOENT, "No such file")) is None
    assert storage.write_failure(ValueError("bad value")) is None
    assert storage.reason(wrapped) == "[Errno 28] No space left on device"
    assert [storage.human_bytes(n) for n in (0, 999, 1500, 2_500_000, None)] == [
        "0 B",
        "999 B",
        "1.5 kB",
        "2.5 MB",
        "unknown",
    ]


def test_a_folder_write_that_fails_leaves_the_old_folder_and_no_partial_one(tmp_path):
    dest = tmp_path / "final"
    dest.mkdir()
    (dest / "old.txt").write_text("old")

    def write(tmp: Path) -> None:
        (tmp / "model.safetensors").write_bytes(b"x" * 1000)
        raise _enospc()

    with pytest.raises(StorageError) as caught:
        storage.write_folder_atomically(dest, write, "the export", 5_000_000, lambda: "do this next")
    msg = str(caught.value)
    assert msg.startswith(
        f"could not write the export final in {tmp_path}: [Errno 28] No space left on device ("
    )
    assert msg.endswith(" free, needs about 5.0 MB); do this next") and "\n" not in msg
    assert caught.value.exit_code == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no .tmp-final
    assert (dest / "old.txt").read_text() == "old"

    def bug(tmp: Path) -> None:
        raise KeyError("a bug, not the disk")

    with pytest.raises(KeyError):  # anything else is not dressed up as a disk problem
        storage.write_folder_atomically(dest, bug, "the export", None, lambda: "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_a_folder_written_through_a_named_temporary_folder_replaces_the_old_one(tmp_path):
    dest = tmp_path / "final"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    seen = []

    def write(tmp: Path) -> None:
        seen.append(tmp.name)
        (tmp / "new.txt").write_text("new")

    storage.write_folder_atomically(
        dest, write, "the tokenizer", None, lambda: "", tmp=tmp_path / ".tmp-final-1"
    )
    assert seen == [".tmp-final-1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no .tmp-*, no .old-*
    assert [p.name for p in dest.iterdir()] == ["new.txt"]
    fresh = tmp_path / "fresh"
    (tmp_path / ".tmp-fresh").mkdir()
    storage.replace_folder(tmp_path / ".tmp-fresh", fresh)  # no older copy: a plain rename
    assert fresh.is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["final", "fresh"]


def test_bert_mp_export_on_a_full_disk_is_one_line(tmp_path, prepared, monkeypatch, capsys):
    from transformers import PreTrainedModel

    from bert_mp.cli import main

    run = tmp_path / "run"
    cfg = tiny_config(run, max_steps=2, save_every=2, export=False)
    cfg.data.cache_dir = str(tmp_path / "cache")
    train_mod.train(cfg, load_fixture(prepared))
    summary = json.loads((run / "summary.json").read_text())
    summary["data"]["path"] = str(prepared)
    (run / "summary.json").write_text(json.dumps(summary))
    real = PreTrainedModel.save_pretrained

    def save_pretrained(self, folder, *a, **k):
        real(self, folder, *a, **k)
        raise _enospc()

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_pretrained)
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(tmp_path / "exported")]) == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"bert-mp export: error: could not write the export exported in {tmp_path}: [Errno 28]"
    ), err
    assert not (tmp_path / "exported").exists() and not (tmp_path / ".tmp-exported").exists()


@pytest.mark.parametrize("where", ["dataset", "stats.json"])
def test_prepare_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, where):
    from datasets import DatasetDict

    from bert_mp.data import prepare as prep
    from bert_mp.data.prepare import build as prep_build

    corpus = write_corpus(tmp_path / "corpus.txt", n_docs=40)
    cfg = load_config(
        None,
        [
            "data.source=text",
            f"data.paths=[{corpus}]",
            "data.vocab_size=200",
            "data.max_seq_length=48",
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
    )
    if where == "dataset":
        real = DatasetDict.save_to_disk

        def save_to_disk(self, path, *a, **k):
            real(self, path, *a, **k)
            raise _enospc()

        monkeypatch.setattr(DatasetDict, "save_to_disk", save_to_disk)
    else:
        real_json = prep_build.atomic_write_json
        monkeypatch.setattr(
            prep_build,
            "atomic_write_json",
            lambda p, o: (
                (_ for _ in ()).throw(_enospc()) if Path(p).name == "stats.json" else real_json(p, o)
            ),
        )
    final = prep.cache_path(cfg.data)
    with pytest.raises(StorageError) as caught:
        prep.prepare(cfg)
    msg = str(caught.value)
    assert msg.startswith(f"could not write the prepared data in {final.parent}: [Errno 28] No space left")
    assert f"nothing written to {final}. Free disk space (or set data.cache_dir" in msg and "\n" not in msg
    assert not final.exists() and not list(final.parent.glob(".tmp-*"))


def test_a_run_log_write_the_disk_refuses_names_the_last_checkpoint(tmp_path, prepared, monkeypatch):
    from bert_mp.core.storage.files import JsonlWriter

    run = tmp_path / "run"
    cfg = tiny_config(run, max_steps=8, save_every=2, export=False)
    real = JsonlWriter.write

    def write(self, obj):
        if obj.get("step") == 5:
            raise _enospc()
        return real(self, obj)

    monkeypatch.setattr(JsonlWriter, "write", write)
    with pytest.raises(TrainingError) as caught:
        train_mod.train(cfg, load_fixture(prepared))
    msg = str(caught.value)
    assert msg.startswith(f"could not write metrics.jsonl in {run}: [Errno 28] No space left on device (")
    assert msg.endswith(
        "the last complete checkpoint, step_00000004, is intact. Free disk space and rerun with train.resume=latest"
    )
    assert json.loads((run / "summary.json").read_text())["error"] == msg
    shutil.rmtree(run)
