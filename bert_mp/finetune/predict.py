"""``bert-mp predict MODEL FILE``: a fine-tuned classifier over a CSV / TSV / JSON Lines / Parquet file.

Writes one prediction per row (``predictions.jsonl``) and, when the file has the label column, the
metrics fine-tuning reports (accuracy, macro-F1, MCC, per-class F1) into ``metrics.json``: the
Hugging Face ``do_predict`` habit. A folder fine-tuned by ``bert-mp finetune`` carries its task record
(:class:`bert_mp.finetune.tasks.TaskRecord`): predict reads the same columns and cuts at the same
length by default, and applies the same row and label rules (:func:`~bert_mp.finetune.tasks.row_problem`,
:func:`~bert_mp.finetune.tasks.normalize_label`), so its metrics on fine-tuning's test file are
fine-tuning's own.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bert_mp.core.checkpoint.hf_folder import verify_export
from bert_mp.core.storage.files import atomic_write_json, looks_like_local_path
from bert_mp.errors import ConfigError, DataError
from bert_mp.finetune.predict_args import add_arguments  # noqa: F401 (the command's arguments)
from bert_mp.finetune.tasks import LabelSpace, TaskRecord, encode_labels, normalize_label, row_problem
from bert_mp.model.hub import resolve_hub_model

_MIN_LENGTH = 8
"""The shortest --max-seq-length (as for finetune.max_seq_length)."""


@dataclass
class Columns:
    """The file's columns predict reads, and which of them the user named (a named one must exist)."""

    text: str
    text_pair: str | None
    label: str | None
    named: frozenset[str] = frozenset()


def resolve_classifier(ref: str) -> str:
    """The folder (a finetune run folder means its final/, its weights verified) or the Hub name that
    ``bert-mp predict MODEL`` loads; a local-looking path that is no folder fails at once."""
    path = Path(ref).expanduser()
    if path.is_dir() and not (path / "config.json").is_file() and (path / "final" / "config.json").is_file():
        path = path / "final"
    if not path.is_dir():
        if path.exists() or looks_like_local_path(ref):
            raise ConfigError(f"{ref}: no such folder")
        found = resolve_hub_model(ref, "predict MODEL")  # one quick question, no retries
        path = Path(found) if found != ref else path
    if path.is_dir():
        verify_export(path, "model")  # weights bert_mp wrote must still be the ones it wrote
    return str(path) if path.is_dir() else ref


def load_classifier(ref: str) -> tuple[Any, Any, TaskRecord | None]:
    """A ``save_pretrained`` sequence classifier, its tokenizer and its task record (None for a model not
    fine-tuned by bert_mp). A finetune run folder means its final/."""
    source = resolve_classifier(ref)  # a mistake is one line before transformers loads
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a per-load "Loading weights" bar is noise in a one-shot command
    path = Path(source)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(source)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{ref}: cannot load a sequence classifier ({str(e).splitlines()[0]})") from None
    if getattr(model.config, "problem_type", None) == "regression":
        raise ConfigError(
            f"{ref}: a regression model (one score per input, such as STS-B's); bert-mp predict reads "
            "classifiers - run the model directly (its logits are the scores)"
        )
    record = TaskRecord.read(path) if path.is_dir() else None
    return model.eval(), tokenizer, record


def choose_columns(
    record: TaskRecord | None, text: str | None, text_pair: str | None, label: str | None
) -> Columns:
    """The columns named on the command line, else the ones the model was fine-tuned on, else text/label."""
    named = frozenset(k for k, v in (("text", text), ("text_pair", text_pair), ("label", label)) if v)
    if record is not None:
        text = text or record.text_column
        text_pair = text_pair or record.text_pair_column
        label = label or record.label_column
    return Columns(text or "text", text_pair, label or "label", named)


def check_columns(cols: Columns, present: list[str], data_file: str) -> Columns:
    """Every text column must exist; a label column named on the command line too. A default label
    column that is absent means predictions only (returned with ``label=None``)."""
    flags = {"text": "--text-column", "text_pair": "--text-pair-column", "label": "--label-column"}
    for key, col in (("text", cols.text), ("text_pair", cols.text_pair), ("label", cols.label)):
        if col is None or col in present or (key == "label" and key not in cols.named):
            continue
        raise DataError(
            f"{data_file} has no column {col!r} (columns: {', '.join(present)}); set {flags[key]}"
        )
    label = cols.label if cols.label in present else None
    return Columns(cols.text, cols.text_pair, label, cols.named)


def sequence_limit(model: Any, tokenizer: Any, record: TaskRecord | None, max_seq_length: int | None) -> int:
    """Tokens per input: ``--max-seq-length``, else fine-tuning's length, else the tokenizer's limit."""
    positions = int(model.config.max_position_embeddings)
    if max_seq_length is not None:
        if not _MIN_LENGTH <= max_seq_length <= positions:
            raise ConfigError(
                f"--max-seq-length: {max_seq_length} is outside {_MIN_LENGTH}..{positions} (the model's "
                "position embeddings)"
            )
        return max_seq_length
    if record is not None:
        return min(record.max_seq_length, positions)
    return min(int(tokenizer.model_max_length), positions)


def predict_rows(
    model: Any, tokenizer: Any, texts: list[str], pairs: list[str] | None, batch_size: int, limit: int
) -> tuple[list[int], list[float], list[bool]]:
    """Predicted class ids, their probabilities, and which inputs were longer than ``limit`` (cut there)."""
    import torch

    ids: list[int] = []
    scores: list[float] = []
    cut: list[bool] = []
    for i in range(0, len(texts), batch_size):
        a = texts[i : i + batch_size]
        b = pairs[i : i + batch_size] if pairs else None
        full = tokenizer(a, b, truncation=False, verbose=False)["input_ids"]
        cut += [len(x) > limit for x in full]
        batch = tokenizer(a, b, truncation=True, max_length=limit, padding=True, return_tensors="pt")
        with torch.no_grad():
            probs = model(**batch).logits.float().softmax(-1)
        top = probs.max(-1)
        ids += top.indices.tolist()
        scores += top.values.tolist()
    return ids, scores, cut


def label_space(model: Any, record: TaskRecord | None) -> LabelSpace:
    """Fine-tuning's label space (values and names), or one read from the model's ``id2label``."""
    if record is not None:
        return record.label_space()
    names = [str(model.config.id2label[i]) for i in range(model.config.num_labels)]
    return LabelSpace([normalize_label(n) for n in names], names)


def score(
    gold: list[Any],
    texts: list[Any],
    pairs: list[Any] | None,
    predicted: tuple[list[int], list[bool]],
    space: LabelSpace,
    class_ids: bool,
) -> dict[str, Any]:
    """Metrics over the complete rows (fine-tuning's row rules), counts of the others and of unseen
    labels; ``predicted`` is (class ids, whether each input was cut)."""
    from bert_mp.finetune.metrics import classification_metrics, named_metrics

    ids, cut = predicted
    keep = [
        i
        for i in range(len(gold))
        if row_problem(texts[i], pairs[i] if pairs else None, gold[i], pairs is not None, class_ids) is None
    ]
    gold_ids, unseen = encode_labels([gold[i] for i in keep], space, "predict FILE")
    metrics = classification_metrics(gold_ids, [ids[i] for i in keep])
    return {
        "metrics": named_metrics(metrics, space.metric_names(unseen)),
        "truncated_scored": sum(cut[i] for i in keep),
        "rows_without_text_or_label": len(gold) - len(keep),
        "unseen_labels": unseen,
    }


def predict(
    model_ref: str,
    data_file: str,
    out_dir: str | Path,
    text_column: str | None = None,
    text_pair_column: str | None = None,
    label_column: str | None = None,
    batch_size: int = 64,
    max_seq_length: int | None = None,
) -> dict[str, Any]:
    """Predict every row of ``data_file``; returns metrics.json's content. Columns left None are the
    fine-tuned model's own (its task record), else ``text`` / ``label``."""
    from bert_mp.finetune.tasks import read_table_file

    model, tokenizer, record = load_classifier(model_ref)
    limit = sequence_limit(model, tokenizer, record, max_seq_length)
    ds = read_table_file(data_file, "predict FILE")
    cols = choose_columns(record, text_column, text_pair_column, label_column)
    wanted_label = cols.label
    cols = check_columns(cols, ds.column_names, data_file)
    raw_texts = ds[cols.text]
    raw_pairs = ds[cols.text_pair] if cols.text_pair else None
    texts = ["" if t is None else str(t) for t in raw_texts]
    pairs = ["" if t is None else str(t) for t in raw_pairs] if raw_pairs is not None else None
    ids, scores, cut = predict_rows(model, tokenizer, texts, pairs, batch_size, limit)
    space = label_space(model, record)
    result: dict[str, Any] = {
        "model": model_ref,
        "file": data_file,
        "rows": len(ids),
        "columns": {"text": cols.text, "text_pair": cols.text_pair, "label": cols.label},
        "max_seq_length": limit,
        "truncated": sum(cut),
    }
    gold = ds[cols.label] if cols.label else None
    if gold is not None:
        class_ids = record.class_ids if record else False
        result.update(score(gold, raw_texts, raw_pairs, (ids, cut), space, class_ids))
    else:
        result["no_label_column"] = wanted_label
    write_predictions(Path(out_dir), ids, scores, space.names, result, gold)
    return result


def write_predictions(
    out: Path, ids: list[int], scores: list[float], names: list[str], result: dict, gold: list | None
) -> None:
    """predictions.jsonl (one row per input: its label and probability, with gold labels the normalised
    gold label) and metrics.json."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "predictions.jsonl", "w", encoding="utf-8") as f:
        for row, (i, p) in enumerate(zip(ids, scores)):
            line: dict[str, Any] = {"row": row, "label": names[i], "score": round(p, 6)}
            if gold is not None:
                line["gold"] = normalize_label(gold[row])
            f.write(json.dumps(line) + "\n")
    atomic_write_json(out / "metrics.json", result)


def command(a: argparse.Namespace) -> int:
    if a.batch_size < 1:
        raise ConfigError(f"--batch-size: must be >= 1 (got {a.batch_size})")
    out = a.out or f"{a.file}.predictions"
    r = predict(
        a.model,
        a.file,
        out,
        a.text_column,
        a.text_pair_column,
        a.label_column,
        a.batch_size,
        a.max_seq_length,
    )
    line = (
        f"bert-mp predict: {r['rows']} rows ({r['truncated']} truncated at {r['max_seq_length']} tokens) "
        f"-> {out}/predictions.jsonl"
    )
    if "metrics" in r:
        m = r["metrics"]
        line += (
            f"; accuracy {_fmt(m['accuracy'])}, macro-F1 {_fmt(m['macro_f1'])}, MCC {_fmt(m['mcc'])} "
            f"on {m['examples']} rows"
        )
        if r["rows_without_text_or_label"]:
            line += f" ({r['rows_without_text_or_label']} without text or label: predicted, not scored)"
    else:
        line += f"; no metrics (the file has no {r['no_label_column']!r} column)"
    print(line)
    return 0


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4f}"
