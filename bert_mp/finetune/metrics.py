"""Fine-tuning's metrics: accuracy, macro-F1 and MCC, evaluation of a split, and best-model selection."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F


def classification_metrics(y_true: Sequence[int], y_pred: Sequence[int]) -> dict[str, Any]:
    """Accuracy, macro-F1 and Matthews correlation, plus per-class F1.

    Classes are those occurring in ``y_true`` or ``y_pred`` (scikit-learn's convention). The MCC is
    Gorodkin's multi-class form, which equals the usual binary MCC for two classes.
    """
    n = len(y_true)
    if n == 0:
        return {"accuracy": None, "macro_f1": None, "mcc": None, "per_class_f1": {}, "examples": 0}
    true_counts, pred_counts = Counter(y_true), Counter(y_pred)
    tp = Counter(t for t, p in zip(y_true, y_pred) if t == p)
    classes = sorted(set(true_counts) | set(pred_counts))
    f1 = {}
    for c in classes:
        denom = true_counts[c] + pred_counts[c]
        f1[c] = 2 * tp[c] / denom if denom else 0.0
    correct = sum(tp.values())
    cov_tp = correct * n - sum(true_counts[c] * pred_counts[c] for c in classes)
    cov_pp = n * n - sum(v * v for v in pred_counts.values())
    cov_tt = n * n - sum(v * v for v in true_counts.values())
    mcc = cov_tp / math.sqrt(cov_pp * cov_tt) if cov_pp > 0 and cov_tt > 0 else 0.0
    return {
        "accuracy": correct / n,
        "macro_f1": sum(f1.values()) / len(classes),
        "mcc": mcc,
        "per_class_f1": f1,
        "examples": n,
    }


def evaluate(model: Any, loader: Any, accelerator: Any, plan: Any, num_labels: int) -> dict[str, Any]:
    """Loss (over labels the model knows) and classification metrics on one split."""
    model.eval()
    preds, trues, loss_sum, loss_n = [], [], 0.0, 0
    with torch.no_grad():
        for batch in loader:
            labels = batch.pop("labels")
            with plan.autocast():
                logits = model(**batch).logits
            logits = logits.float()
            known = labels < num_labels
            if known.any():
                loss_sum += float(F.cross_entropy(logits[known], labels[known], reduction="sum"))
                loss_n += int(known.sum())
            p, t = accelerator.gather_for_metrics((logits.argmax(-1), labels))
            preds += p.tolist()
            trues += t.tolist()
    model.train()
    totals = accelerator.reduce(torch.tensor([loss_sum, loss_n], device=accelerator.device), "sum").tolist()
    out = classification_metrics(trues, preds)
    out["loss"] = totals[0] / totals[1] if totals[1] else None
    return out


def log_view(prefix: str, m: dict[str, Any]) -> dict[str, Any]:
    """The metrics.jsonl fields of one split's evaluation: ``<prefix>/loss`` and the headline metrics."""
    return {f"{prefix}/{k}": m[k] for k in ("loss", "accuracy", "macro_f1", "mcc")}


def named_metrics(m: dict[str, Any], names: dict[int, str]) -> dict[str, Any]:
    """Metrics with per-class F1 keyed by label name (``unseen:<label>`` for labels train never had)."""
    out = dict(m)
    out["per_class_f1"] = {names[c]: v for c, v in m["per_class_f1"].items()}
    return out


class BestValidation:
    """The best validation so far (macro-F1) and, with ``select_best``, a CPU copy of its weights.

    Registered with Accelerate for checkpointing, so a resumed run selects from the whole run.
    """

    def __init__(self, keep_weights: bool):
        self.keep_weights = keep_weights
        self.step: int | None = None
        self.metrics: dict[str, Any] | None = None
        self.weights: dict[str, torch.Tensor] | None = None
        self.last_eval_step = -1

    def offer(self, step: int, metrics: dict[str, Any], model: Any) -> None:
        if self.metrics is None or metrics["macro_f1"] > self.metrics["macro_f1"]:
            self.step, self.metrics = step, metrics
            if self.keep_weights:
                self.weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "metrics": self.metrics,
            "weights": self.weights,
            "last": self.last_eval_step,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.step, self.metrics, self.weights = d["step"], d["metrics"], d["weights"]
        self.last_eval_step = d["last"]


def fmt(v: float | None) -> str:
    """A metric for a console line: four decimals, or n/a."""
    return "n/a" if v is None else f"{v:.4f}"
