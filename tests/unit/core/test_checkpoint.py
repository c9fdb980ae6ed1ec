"""checkpoint.py: atomic/corrupt handling, resume checks, HF export (fresh processes: integration/)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import make_prepared, tiny_config
from transformers import BertForPreTraining, BertForSequenceClassification

import bert_mp.pretrain.trainer as train_mod
from bert_mp.core.checkpoint import store as ckpt
from bert_mp.core.storage.files import read_jsonl
from bert_mp.errors import TrainingError
from bert_mp.model.bert import build_model


def _finished_run(tmp_path: Path, **kw) -> tuple[Path, list]:
    data = make_prepared(tmp_path / "data")
    built: list = []

    def build(*a, **k):
        built.append(build_model(*a, **k))
        return built[-1]

    cfg = tiny_config(tmp_path / "run", **{"max_steps": 6, "save_every": 2, "save_total_limit": 2, **kw})
    train_mod.train(cfg, data, build_model=build)
    return tmp_path / "run", built


def test_atomic_layout_rotation_and_corrupt_checkpoints_are_skipped(tmp_path):
    run, _ = _finished_run(tmp_path)
    cdir = run / "checkpoints"
    names = [p.name for p in ckpt.list_checkpoints(cdir)]
    assert names == ["step_00000004", "step_00000006"]  # total_limit=2 kept the newest
    assert not list(cdir.glob(".tmp-*"))
    latest = cdir / "step_00000006"
    assert ckpt.verify(latest) is None and ckpt.find_latest(cdir) == latest
    marker = json.loads((latest / ckpt.MARKER).read_text())
    assert marker["format"] == 2 and marker["hash"] == "xxh3_128"
    assert set(marker["files"]) == {
        "model.safetensors",
        "optimizer.safetensors",
        "custom_state_0.safetensors",  # the scheduler (registered for checkpointing)
        "rng_state_0.safetensors",
        "loop_state.json",
    }  # nothing pickled
    assert all(len(e["xxh3_128"]) == 32 for e in marker["files"].values())

    # a truncated file in the newest checkpoint: skipped with a warning, the older one is used
    model_file = latest / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:100])
    with pytest.warns(UserWarning, match="truncated"):
        assert ckpt.find_latest(cdir) == cdir / "step_00000004"
    with pytest.raises(TrainingError, match="truncated"):
        ckpt.resolve_resume(str(latest), cdir)
    # a checkpoint interrupted before its marker: never loaded
    (cdir / "step_00000004" / ckpt.MARKER).unlink()
    with pytest.warns(UserWarning) as caught:
        assert ckpt.find_latest(cdir) is None
    reasons = sorted(str(w.message).split(": ", 1)[1] for w in caught)
    assert (
        reasons[0]
        == "model.safetensors has 100 bytes, expected "
        + str(marker["files"]["model.safetensors"]["size"])
        + " (truncated or altered)"
    )
    assert reasons[1] == "no COMPLETE marker (interrupted while saving)"
    # temp folders (a save in flight) are not even candidates
    (cdir / ".tmp-step_00000008").mkdir()
    assert [p.name for p in ckpt.list_checkpoints(cdir)] == ["step_00000004", "step_00000006"]


def test_resume_latest_without_checkpoints_starts_fresh(tmp_path):
    data = make_prepared(tmp_path / "data")
    cfg = tiny_config(tmp_path / "run", max_steps=2, resume="latest", export=False)
    with pytest.warns(UserWarning, match="starting fresh"):
        summary = train_mod.train(cfg, data)
    assert summary["steps"] == 2 and summary["resumed_from"] is None


def test_resume_without_metrics_log_continues(tmp_path):
    """Checkpoints copied elsewhere without metrics.jsonl still resume; the new log starts there."""
    data = make_prepared(tmp_path / "data")
    cfg = tiny_config(tmp_path / "run", max_steps=2, save_every=1, export=False)
    train_mod.train(cfg, data)
    (tmp_path / "run" / "metrics.jsonl").unlink()
    cfg.train.max_steps, cfg.train.resume = 3, "latest"
    summary = train_mod.train(cfg, data)
    assert summary["steps"] == 3 and summary["resumed_from"].endswith("step_00000002")
    steps = [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == [3]


def test_export_loads_with_plain_transformers_and_reproduces_logits(tmp_path):
    run, built = _finished_run(tmp_path)
    trained = built[0].eval()
    final = run / "final"
    assert (final / "model.safetensors").is_file() and (final / "tokenizer.json").is_file()
    batch = {
        "input_ids": torch.tensor([[2, 7, 8, 7, 4, 3, 8, 7, 3]]),
        "token_type_ids": torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 1]]),
        "attention_mask": torch.ones(1, 9, dtype=torch.long),
    }
    loaded = BertForPreTraining.from_pretrained(final).eval()
    with torch.no_grad():
        ref = trained(**batch)
        got = loaded(**batch)
    assert torch.equal(ref.prediction_logits, got.prediction_logits)
    assert torch.equal(ref.seq_relationship_logits, got.seq_relationship_logits)
    cls = BertForSequenceClassification.from_pretrained(final, num_labels=3).eval()
    with torch.no_grad():
        pooled = cls.bert(**batch).pooler_output
        assert torch.equal(pooled, trained.bert(**batch).pooler_output)
        assert cls(**batch).logits.shape == (1, 3)
    from transformers import AutoTokenizer, pipeline

    tok = AutoTokenizer.from_pretrained(final)
    assert len(tok) == 64
    # the tokenizer knows the model's length limit, so a long input is cut, not a crash
    assert tok.model_max_length == loaded.config.max_position_embeddings
    words = tok.convert_ids_to_tokens(list(range(5, 64)))
    text = " ".join(words[i % len(words)] for i in range(2000))
    fill = pipeline("fill-mask", model=str(final), tokenizer_kwargs={"truncation": True})
    assert len(fill(f"{tok.mask_token} {text}")) == 5
    card = (final / "README.md").read_text()
    assert "pipeline_tag: fill-mask" in card and "6 optimizer steps" in card and "fp32" in card


def test_bert_mp_export_rebuilds_the_model_from_a_checkpoint(tmp_path):
    from bert_mp.cli import main
    from bert_mp.errors import ConfigError
    from bert_mp.pretrain.export import export_checkpoint

    run, _ = _finished_run(tmp_path)
    final = load_file(str(run / "final" / "model.safetensors"))
    # the run's newest checkpoint (step 6) holds the weights of the final export
    assert main(["export", str(run), "--out", str(tmp_path / "exported")]) == 0
    got = load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert got.keys() == final.keys() and all(torch.equal(got[k], final[k]) for k in final)
    assert "step_00000006" in (tmp_path / "exported" / "README.md").read_text()
    older = export_checkpoint(run / "checkpoints" / "step_00000004")
    assert older == run / "export-step_00000004" and (older / "tokenizer_config.json").is_file()
    assert not all(torch.equal(load_file(str(older / "model.safetensors"))[k], final[k]) for k in final)
    with pytest.raises(ConfigError, match="already a Hugging Face folder"):
        export_checkpoint(run / "final")
    with pytest.raises(ConfigError, match="no such folder"):
        export_checkpoint(tmp_path / "nope")


def test_atomic_writes_get_the_umask_mode_not_the_temporary_files_0600(tmp_path):

    from bert_mp.core.storage.files import atomic_write_json

    old = os.umask(0o027)
    try:
        atomic_write_json(tmp_path / "a.json", {"x": 1})
        assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o640
        os.umask(0o022)
        atomic_write_json(tmp_path / "a.json", {"x": 2})  # a rewrite follows the umask of its time
        assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(old)


def test_resume_from_an_export_or_a_run_folder_says_what_to_do(tmp_path):
    run, _ = _finished_run(tmp_path)
    cdir = run / "checkpoints"
    with pytest.raises(TrainingError, match=r"is a Hugging Face export .*model\.init_from="):
        ckpt.resolve_resume(str(run / "final"), cdir)
    with pytest.raises(TrainingError, match=r"is a run folder; .*train\.resume=latest"):
        ckpt.resolve_resume(str(run), cdir)
    assert ckpt.resolve_resume(str(cdir / "step_00000006"), cdir) == cdir / "step_00000006"
