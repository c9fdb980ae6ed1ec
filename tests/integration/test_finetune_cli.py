"""Fine-tuning end to end through the CLI: ``bert-mp finetune`` learns a tiny task and exports it,
``bert-mp predict`` reproduces its test metrics from the export."""

import json
import os
import sys

import forkserver
import pytest
import torch
from support import finetune_overrides as _overrides
from support import sentence
from transformers import AutoTokenizer, BertForSequenceClassification


# --------------------------------------------------------------------------------------------------
# runs
# --------------------------------------------------------------------------------------------------
def test_cli_end_to_end_learns_and_exports(tmp_path, ckpt):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = forkserver.run(
        [sys.executable, "-m", "bert_mp", "finetune", *_overrides(ckpt, tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "test" in proc.stdout and "macro-F1" in proc.stdout
    assert "bert-mp finetune: step 6 validation: loss" in proc.stdout  # printed when computed
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 4 * 6
    assert summary["loading"]["newly_initialized"] == ["classifier.bias", "classifier.weight"]
    assert summary["test"]["accuracy"] >= 0.9, summary["test"]
    assert summary["task"]["labels"] == ["apple", "stone"]
    kinds = [json.loads(line)["kind"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert kinds.count("train") == 24 and kinds.count("eval") == 4 and kinds[-1] == "test"
    assert (out / "config.yaml").is_file()
    # The export is plain transformers and predicts with the string labels.
    model = BertForSequenceClassification.from_pretrained(out / "final").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    with torch.no_grad():
        logits = model(
            **tokenizer([sentence(1, "apple"), sentence(2, "stone")], return_tensors="pt", padding=True)
        ).logits
    assert [model.config.id2label[i] for i in logits.argmax(-1).tolist()] == ["apple", "stone"]
    # ... and works in a pipeline on an input far beyond the model's positions, truncated where
    # fine-tuning truncated: the tokenizer carries finetune.max_seq_length
    from transformers import pipeline

    assert tokenizer.model_max_length == summary["task"]["max_seq_length"] == 32
    clf = pipeline("text-classification", model=str(out / "final"), truncation=True)
    long_text = " ".join([sentence(1, "apple")] * 400)  # > 2,000 words
    assert len(long_text.split()) > 2000 and clf(long_text)[0]["label"] in ("apple", "stone")
    card = (out / "final" / "README.md").read_text()
    assert "pipeline_tag: text-classification" in card and "apple" in card and "test macro-F1" in card

    # bert-mp predict on the test file reproduces fine-tuning's test metrics from the export
    pred = forkserver.run(
        [
            sys.executable,
            "-m",
            "bert_mp",
            "predict",
            str(out),
            str(tmp_path / "test.csv"),
            "--out",
            str(tmp_path / "p"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert pred.returncode == 0, pred.stderr[-3000:]
    metrics = json.loads((tmp_path / "p" / "metrics.json").read_text())
    assert metrics["rows"] == 24 and metrics["unseen_labels"] == {}
    assert metrics["metrics"]["accuracy"] == pytest.approx(summary["test"]["accuracy"])
    assert metrics["metrics"]["macro_f1"] == pytest.approx(summary["test"]["macro_f1"])
    rows = [json.loads(line) for line in (tmp_path / "p" / "predictions.jsonl").read_text().splitlines()]
    assert [r["row"] for r in rows] == list(range(24)) and {r["label"] for r in rows} <= {"apple", "stone"}
    bad = forkserver.run(
        [
            sys.executable,
            "-m",
            "bert_mp",
            "predict",
            str(out),
            str(tmp_path / "test.csv"),
            "--text-column",
            "body",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert (
        bad.returncode == 2
        and "has no column 'body'" in bad.stderr
        and len(bad.stderr.strip().splitlines()) == 1
    )
