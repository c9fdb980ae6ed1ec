"""``bert-mp predict MODEL FILE``: a fine-tuned classifier over a CSV / TSV / JSON Lines / Parquet file.

Writes one prediction per row (``predictions.jsonl``: row index, label, score) and, when the file
has a label column, the metrics fine-tuning reports (accuracy, macro-F1, MCC, per-class F1) into
``metrics.json``: the Hugging Face ``do_predict`` habit. Inputs longer than the model's positions
are truncated (and counted).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bert_mp.core.export import verify_export
from bert_mp.core.io import atomic_write_json, looks_like_local_path
from bert_mp.errors import ConfigError, DataError


def load_classifier(ref: str) -> tuple[Any, Any]:
    """A ``save_pretrained`` sequence classifier and its tokenizer (a finetune run folder means its final/)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a per-load "Loading weights" bar is noise in a one-shot command
    path = Path(ref).expanduser()
    if path.is_dir() and not (path / "config.json").is_file() and (path / "final" / "config.json").is_file():
        path = path / "final"
    if not path.is_dir() and looks_like_local_path(ref):
        raise ConfigError(f"{ref}: no such folder")
    if path.is_dir():
        verify_export(path, "model")  # weights bert_mp wrote must still be the ones it wrote
    try:
        model = AutoModelForSequenceClassification.from_pretrained(str(path) if path.is_dir() else ref)
        tokenizer = AutoTokenizer.from_pretrained(str(path) if path.is_dir() else ref)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{ref}: cannot load a sequence classifier ({str(e).splitlines()[0]})") from None
    return model.eval(), tokenizer


def predict_rows(
    model: Any, tokenizer: Any, texts: list[str], pairs: list[str] | None, batch_size: int
) -> tuple[list[int], list[float], int]:
    """Predicted class ids, their probabilities, and how many inputs were truncated."""
    import torch

    limit = min(int(tokenizer.model_max_length), model.config.max_position_embeddings)
    ids: list[int] = []
    scores: list[float] = []
    truncated = 0
    for i in range(0, len(texts), batch_size):
        a = texts[i : i + batch_size]
        b = pairs[i : i + batch_size] if pairs else None
        full = tokenizer(a, b, truncation=False)["input_ids"]
        truncated += sum(len(x) > limit for x in full)
        batch = tokenizer(a, b, truncation=True, max_length=limit, padding=True, return_tensors="pt")
        with torch.no_grad():
            probs = model(**batch).logits.float().softmax(-1)
        top = probs.max(-1)
        ids += top.indices.tolist()
        scores += top.values.tolist()
    return ids, scores, truncated


def predict(
    model_ref: str,
    data_file: str,
    out_dir: str | Path,
    text_column: str = "text",
    text_pair_column: str | None = None,
    label_column: str | None = "label",
    batch_size: int = 64,
) -> dict[str, Any]:
    """Predict every row of ``data_file``; returns metrics.json's content."""
    from bert_mp.finetune.tasks import read_table_file
    from bert_mp.finetune.trainer import classification_metrics

    model, tokenizer = load_classifier(model_ref)
    ds = read_table_file(data_file, "predict FILE")
    for col in (text_column, text_pair_column):
        if col and col not in ds.column_names:
            raise DataError(
                f"{data_file} has no column {col!r} (columns: {', '.join(ds.column_names)}); set --text-column"
            )
    texts = ["" if t is None else str(t) for t in ds[text_column]]
    pairs = ["" if t is None else str(t) for t in ds[text_pair_column]] if text_pair_column else None
    ids, scores, truncated = predict_rows(model, tokenizer, texts, pairs, batch_size)
    id2label = {int(k): str(v) for k, v in model.config.id2label.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "predictions.jsonl", "w", encoding="utf-8") as f:
        for row, (i, score) in enumerate(zip(ids, scores)):
            f.write(json.dumps({"row": row, "label": id2label[i], "score": round(score, 6)}) + "\n")
    result: dict[str, Any] = {"model": model_ref, "file": data_file, "rows": len(ids), "truncated": truncated}
    if label_column and label_column in ds.column_names:
        label2id = {v: k for k, v in id2label.items()}
        gold = [str(v) for v in ds[label_column]]
        unknown = sorted({g for g in gold if g not in label2id})
        # a label the model never learned gets an id of its own: always wrong, and counted
        extra = {g: len(id2label) + n for n, g in enumerate(unknown)}
        metrics = classification_metrics([label2id.get(g, extra.get(g)) for g in gold], ids)
        names = {**id2label, **{v: f"unseen:{k}" for k, v in extra.items()}}
        metrics["per_class_f1"] = {names[k]: v for k, v in metrics["per_class_f1"].items()}
        result.update(metrics=metrics, unseen_labels=unknown)
    atomic_write_json(out / "metrics.json", result)
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's arguments (the CLI's subparser gets them from here)."""
    p.add_argument(
        "model", help="a fine-tuned folder (bert-mp finetune's final/, or its run folder) or Hub name"
    )
    p.add_argument("file", help="CSV / TSV / JSON Lines / Parquet file")
    p.add_argument("--out", default=None, help="output folder (default: <file>.predictions/)")
    p.add_argument("--text-column", default="text")
    p.add_argument("--text-pair-column", default=None)
    p.add_argument("--label-column", default="label", help="gold labels, if present: metrics are computed")
    p.add_argument("--batch-size", type=int, default=64)


def command(a: argparse.Namespace) -> int:
    if a.batch_size < 1:
        raise ConfigError(f"--batch-size: must be >= 1 (got {a.batch_size})")
    out = a.out or f"{a.file}.predictions"
    r = predict(a.model, a.file, out, a.text_column, a.text_pair_column, a.label_column, a.batch_size)
    line = f"bert-mp predict: {r['rows']} rows ({r['truncated']} truncated) -> {out}/predictions.jsonl"
    if "metrics" in r:
        m = r["metrics"]
        line += f"; accuracy {m['accuracy']:.4f}, macro-F1 {m['macro_f1']:.4f}, MCC {m['mcc']:.4f}"
    print(line)
    return 0
