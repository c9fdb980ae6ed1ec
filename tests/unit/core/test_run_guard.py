"""Run folders are never silently reused; a resume refuses a change of weights or data and records
any other change."""

from __future__ import annotations

import pytest
from support import make_prepared, tiny_config

from bert_mp.core.config import config_to_dict
from bert_mp.core.process.run_dir import changed_since, config_changes, shape_changes
from bert_mp.core.storage.files import read_jsonl
from bert_mp.errors import ConfigError
from bert_mp.pretrain.trainer import train


@pytest.fixture
def finished(tmp_path):
    data = make_prepared(tmp_path / "data")
    cfg = tiny_config(tmp_path / "run", max_steps=3, save_every=1, export=False)
    train(cfg, data)
    return cfg, data, tmp_path / "run"


def test_an_existing_run_folder_is_refused_without_resume_or_overwrite(finished):
    cfg, data, run = finished
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(ConfigError) as e:
        train(cfg, data)
    msg = str(e.value)
    assert msg.startswith(
        f"train.output_dir={run} already holds a run (metrics.jsonl, summary.json, checkpoints)"
    )
    assert "train.resume=latest" in msg and "train.overwrite_output_dir=true" in msg and "\n" not in msg
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before  # nothing touched


def test_overwrite_starts_over_without_leftovers(finished):
    cfg, data, run = finished
    cfg.train.overwrite_output_dir, cfg.train.max_steps, cfg.train.save_every = True, 2, 0
    summary = train(cfg, data)
    assert summary["steps"] == 2 and summary["resumed_from"] is None
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"] == [1, 2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]  # old ones gone


def test_resume_refuses_a_model_change_before_any_work(finished):
    cfg, data, run = finished
    saved = (run / "config.yaml").read_bytes()
    cfg.train.resume = "latest"
    cfg.model.hidden_size = 64
    with pytest.raises(
        ConfigError,
        match=r"^train\.resume: the run in .* other weights or data \(model\.hidden_size: 32 -> 64\)",
    ):
        train(cfg, data)
    assert (run / "config.yaml").read_bytes() == saved


def test_resume_records_and_prints_allowed_changes(finished, capsys):
    cfg, data, run = finished
    cfg.train.resume, cfg.train.max_steps, cfg.train.learning_rate = "latest", 5, 0.001
    summary = train(cfg, data)
    assert summary["steps"] == 5
    rows = list(read_jsonl(run / "metrics.jsonl"))
    (change,) = [r for r in rows if r["kind"] == "config_change"]
    assert change["step"] == 3
    assert change["changes"] == {
        "train.learning_rate": {"old": 0.003, "new": 0.001},
        "train.max_steps": {"old": 3, "new": 5},
    }
    out = capsys.readouterr().out
    assert "bert-mp train: resuming from step 3 (checkpoint" in out and "train.max_steps: 3 -> 5" in out
    assert "bert-mp train: step 5 eval: MLM loss" in out  # evaluations are printed when computed


def test_which_changes_a_resume_refuses():
    cfg = tiny_config("x")
    old = config_to_dict(cfg)
    new = config_to_dict(cfg)
    new["train"].update(precision="bf16", micro_batch_size=4, output_dir="elsewhere", resume="latest")
    new["data"]["max_seq_length"] = 64
    new["data"]["num_proc"] = 4
    new["model"]["num_hidden_layers"] = 4
    changes = config_changes(old, new, "train")
    assert set(changes) == {
        "train.precision",
        "train.micro_batch_size",
        "data.max_seq_length",
        "data.num_proc",
        "model.num_hidden_layers",
    }
    assert sorted(shape_changes(changes)) == ["data.max_seq_length", "model.num_hidden_layers"]
    assert config_changes(old, new, "finetune") == {}  # fine-tuning reads neither section


def test_sweep_runs_are_keyed_by_their_resolved_config(finished):
    cfg, _, run = finished
    assert changed_since(run, cfg, "train") == {}
    cfg.train.max_steps = 40
    assert changed_since(run, cfg, "train") == {"train.max_steps": (3, 40)}
    assert changed_since(run.parent / "nothing-here", cfg, "train") == {}


def test_a_key_the_saved_config_lacks_is_no_change_at_its_default():
    """A run saved before a key existed (hardware.flush_denormal, say) resumes, and is kept by a sweep,
    unless the key is now set to something else."""
    cfg = tiny_config("x")
    old = config_to_dict(cfg)
    del old["hardware"]["flush_denormal"]
    assert config_changes(old, config_to_dict(cfg), "train") == {}
    cfg.hardware.flush_denormal = True
    assert config_changes(old, config_to_dict(cfg), "train") == {"hardware.flush_denormal": (None, True)}
