"""``bert-mp export RUN --push_to_hub REPO``: huggingface_hub's own upload, tested at its boundary (the
``HfApi`` methods replaced in this process, what they were given asserted; no network)."""

from __future__ import annotations

import pytest
from huggingface_hub import HfApi
from support import make_prepared, tiny_config

import bert_mp.pretrain.trainer as train_mod
from bert_mp.cli import main


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("push")
    cfg = tiny_config(root / "run", max_steps=4, save_every=2)
    train_mod.train(cfg, make_prepared(root / "data"))
    return root / "run"


@pytest.fixture
def hub(monkeypatch):
    """The Hub's three calls, recorded; the uploaded folder's file names kept as they were then."""
    calls = []

    def create_repo(self, repo_id, **kw):
        calls.append(("create_repo", repo_id, kw))
        return f"https://huggingface.co/{repo_id}"

    def create_branch(self, repo_id, **kw):
        calls.append(("create_branch", repo_id, kw))

    def upload_folder(self, **kw):
        from pathlib import Path

        kw["files"] = sorted(p.name for p in Path(kw["folder_path"]).iterdir())
        calls.append(("upload_folder", kw.pop("repo_id"), kw))
        return type("CommitInfo", (), {"commit_url": "https://huggingface.co/me/tiny/commit/abc"})()

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_branch", create_branch)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return calls


def test_an_intermediate_checkpoint_goes_up_as_a_revision_with_its_model_card(run, tmp_path, hub, capsys):
    ckpt = run / "checkpoints" / "step_00000002"
    out = tmp_path / "export"
    assert (
        main(
            [
                "export",
                str(ckpt),
                "--out",
                str(out),
                "--push_to_hub",
                "me/tiny",
                "--revision",
                "step-2",
                "--private",
            ]
        )
        == 0
    )
    assert [c[0] for c in hub] == ["create_repo", "create_branch", "upload_folder"]
    assert hub[0][1:] == ("me/tiny", {"private": True, "exist_ok": True, "repo_type": "model"})
    assert hub[1][1:] == ("me/tiny", {"branch": "step-2", "exist_ok": True, "repo_type": "model"})
    name, repo, up = hub[2]
    assert repo == "me/tiny" and up["folder_path"] == str(out) and up["revision"] == "step-2"
    assert {"README.md", "config.json", "model.safetensors", "checksums.json", "tokenizer.json"} <= set(
        up["files"]
    )
    assert "step_00000002" in up["commit_message"]
    assert "-> me/tiny@step-2 (https://huggingface.co/me/tiny/commit/abc)" in capsys.readouterr().out


def test_main_needs_no_branch(run, tmp_path, hub):
    assert main(["export", str(run), "--out", str(tmp_path / "e"), "--push_to_hub", "me/tiny"]) == 0
    assert [c[0] for c in hub] == ["create_repo", "upload_folder"]
    assert hub[0][2]["private"] is False and hub[1][2]["revision"] is None


def test_a_checkpoint_that_fails_its_verification_is_never_sent(run, tmp_path, hub, capsys):
    import shutil

    bad = tmp_path / "step_00000004"
    shutil.copytree(run / "checkpoints" / "step_00000004", bad)
    weights = bad / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x10
    weights.write_bytes(bytes(data))
    assert main(["export", str(bad), "--out", str(tmp_path / "e"), "--push_to_hub", "me/tiny"]) == 2
    assert hub == [] and "cannot export this checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


def test_a_refusal_of_the_hub_is_one_line_and_the_export_stays(run, tmp_path, monkeypatch, capsys):
    def no_token(self, repo_id, **kw):
        raise OSError("401 Client Error: Unauthorized for url: https://huggingface.co/api/repos/create\nmore")

    monkeypatch.setattr(HfApi, "create_repo", no_token)
    out = tmp_path / "kept"
    assert main(["export", str(run), "--out", str(out), "--push_to_hub", "me/tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "the Hub refused the upload (401 Client Error" in err[0]
        and "hf auth login" in err[0]
    )
    assert (out / "model.safetensors").is_file()


def test_mistakes_before_any_export(run, tmp_path, capsys):
    assert main(["export", str(run), "--push_to_hub", "not a repo"]) == 2
    assert main(["export", str(run), "--private"]) == 2
    err = capsys.readouterr().err
    assert "is not a Hub repository id" in err and "--revision and --private go with --push_to_hub" in err
    assert not list(run.glob("export-*"))
