"""``data.objective=mlm`` end to end through the real CLI: prepare -> train (the loss falls, no NSP
metrics) -> a tiny sweep's verdicts -> the export -> fine-tuning from it."""

from __future__ import annotations

import json

from support import finetune_overrides, run_cli
from transformers import BertForPreTraining, BertForSequenceClassification

from bert_mp.core.storage.files import read_jsonl
from bert_mp.pretrain.parity_monitor import load_curves
from bert_mp.sweep.parity import VerdictRules, verdict


def test_mlm_objective_prepare_train_sweep_export_finetune(tmp_path):
    data = [
        "data.objective=mlm",
        "data.max_documents=60",
        "data.vocab_size=512",
        "data.max_seq_length=32",
        f"data.cache_dir={tmp_path / 'data'}",
    ]
    model = [
        "model.hidden_size=32",
        "model.num_attention_heads=2",
        "model.intermediate_size=64",
        "model.max_position_embeddings=64",
    ]
    train = [
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
        "train.learning_rate=0.006",
        "train.warmup_steps=2",
        "train.eval_max_batches=2",
        "train.progress_bar=false",
    ]
    proc = run_cli("prepare", *data, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "examples (mlm)" in proc.stdout and "no NSP labels" in proc.stdout

    run = tmp_path / "run"
    proc = run_cli(
        "train", *data, *model, *train, "train.max_steps=30", f"train.output_dir={run}", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(read_jsonl(run / "metrics.jsonl"))
    steps = [r for r in rows if r["kind"] == "train"]
    assert len(steps) == 30
    assert all(r["loss/nsp"] is None and r["accuracy/nsp"] is None for r in steps)
    assert all(r["loss/total"] == r["loss/mlm"] for r in steps)
    first = sum(r["loss/mlm"] for r in steps[:5]) / 5
    last = sum(r["loss/mlm"] for r in steps[-5:]) / 5
    assert last < first - 0.2, (first, last)  # nats: from ~ln(vocab) towards the unigram entropy
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["final_eval"]["eval/loss_nsp"] is None and summary["final_eval"]["eval/loss_mlm"] > 0
    # the export is the standard HF layout, NSP head included
    exported = BertForPreTraining.from_pretrained(run / "final")
    assert exported.cls.seq_relationship.weight.shape[0] == 2

    sweep = tmp_path / "sweep"
    proc = run_cli(
        "sweep",
        *data,
        *model,
        *train,
        "train.max_steps=12",
        "train.eval_every=6",
        "train.export=false",
        f"sweep.output_dir={sweep}",
        "sweep.precisions=[fp32,tf32]",
        "sweep.reference_seed=7",
        "sweep.parity_window=4",
        "sweep.profile_steps=0",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdicts = json.loads((sweep / "summary.json").read_text())["groups"][0]["verdicts"]
    assert verdicts["fp32"]["status"] == "reference"
    # tf32 runs where the CPU has bf16 matmuls, and is skipped with a reason where it does not
    assert verdicts["tf32"]["status"] in ("pass", "warn", "fail", "skipped")
    assert "NSP is not used" in (sweep / "report.md").read_text()
    # the parity verdict on two fp32 seeds of an mlm run: MLM checks measured, NSP checks n/a
    runs = sorted(p for p in (sweep / "runs").iterdir() if (p / "metrics.jsonl").is_file())
    assert len(runs) >= 2
    ref, other = load_curves(runs[0]), load_curves(runs[1])
    v = verdict(other, ref, None, VerdictRules(window=4))
    assert v.status in ("pass", "warn", "fail") and not any("non-finite" in r for r in v.reasons)
    assert v.checks["train:loss/mlm"]["value"] is not None
    assert v.checks["train:loss/nsp"]["status"] == "n/a" and v.checks["eval:eval/loss_nsp"]["status"] == "n/a"

    out = tmp_path / "ft"
    proc = run_cli(
        "finetune",
        *finetune_overrides(run / "final", tmp_path, output_dir=out, epochs=3, save_model=True),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ft = json.loads((out / "summary.json").read_text())
    assert ft["status"] == "completed" and ft["loading"]["newly_initialized"] == [
        "classifier.bias",
        "classifier.weight",
    ]
    assert BertForSequenceClassification.from_pretrained(out / "final").config.num_labels == 2
