"""Fine-tuning's metrics: classification (accuracy, macro-F1, MCC) and regression (Pearson, Spearman),
the loss of either kind of head, evaluation of a split, and best-model selection.

The numbers are scikit-learn's and SciPy's own (``sklearn.metrics``, ``scipy.stats``), not written
here by hand; both are imported when a metric is first computed, so a command that computes none
does not pay their start-up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

CLASSIFICATION_KEYS = ("loss", "accuracy", "macro_f1", "mcc")
"""The headline metrics of a classification split (metrics.jsonl, the console)."""
REGRESSION_KEYS = ("loss", "pearson", "spearman", "mse")
"""The headline metrics of a regression split (STS-B)."""


def classification_metrics(y_true: Sequence[int], y_pred: Sequence[int]) -> dict[str, Any]:
    """Accuracy, macro-F1 and Matthews correlation, plus per-class F1 (scikit-learn's).

    Classes are those occurring in ``y_true`` or ``y_pred`` (scikit-learn's convention). The MCC is
    scikit-learn's multi-class form (Gorodkin's), which equals the usual binary MCC for two classes,
    and is 0 where it is undefined (one side constant).
    """
    n = len(y_true)
    if n == 0:
        return {"accuracy": None, "macro_f1": None, "mcc": None, "per_class_f1": {}, "examples": 0}
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

    classes = sorted(set(y_true) | set(y_pred))
    per_class = f1_score(y_true, y_pred, labels=classes, average=None, zero_division=0.0)
    return {
        "accuracy": float(accuracy_score(y_true, y_pred)),
        "macro_f1": float(per_class.mean()),
        "mcc": float(matthews_corrcoef(y_true, y_pred)),
        "per_class_f1": {c: float(f) for c, f in zip(classes, per_class)},
        "examples": n,
    }


def regression_metrics(y_true: Sequence[float], y_pred: Sequence[float]) -> dict[str, Any]:
    """Pearson and Spearman correlation (SciPy's) and the mean squared error of a regression split.

    A correlation with a constant side is undefined (SciPy gives NaN); it is 0 here, as scikit-learn's
    MCC is for constant predictions, so a model that learned nothing scores 0 rather than no number.
    """
    n = len(y_true)
    if n == 0:
        return {"pearson": None, "spearman": None, "mse": None, "examples": 0}
    import numpy as np
    from scipy.stats import pearsonr, spearmanr

    t, p = np.asarray(y_true, dtype=np.float64), np.asarray(y_pred, dtype=np.float64)
    constant = n < 2 or np.ptp(t) == 0 or np.ptp(p) == 0
    return {
        "pearson": 0.0 if constant else float(pearsonr(t, p).statistic),
        "spearman": 0.0 if constant else float(spearmanr(t, p).statistic),
        "mse": float(np.mean((t - p) ** 2)),
        "examples": n,
    }


def task_loss(
    logits: torch.Tensor, targets: torch.Tensor, regression: bool, reduction: str = "mean"
) -> torch.Tensor:
    """The training loss in fp32 whatever the precision: cross-entropy, or for a regression head
    (one output, ``problem_type="regression"``) the mean squared error, as transformers' own
    ``BertForSequenceClassification`` computes them."""
    if regression:
        return F.mse_loss(logits.float().squeeze(-1), targets.float(), reduction=reduction)
    return F.cross_entropy(logits.float(), targets, reduction=reduction)


def evaluate(model: Any, loader: Any, accelerator: Any, plan: Any, labels: Any) -> dict[str, Any]:
    """Loss and metrics on one split; ``labels`` is the run's :class:`~bert_mp.finetune.tasks.LabelSpace`
    (a regression space: one output, Pearson / Spearman; else the loss over the labels the model
    knows, and classification metrics)."""
    model.eval()
    preds, trues, loss_sum, loss_n = [], [], 0.0, 0
    with torch.no_grad():
        for batch in loader:
            targets = batch.pop("labels")
            with plan.autocast():
                logits = model(**batch).logits
            logits = logits.float()
            known = torch.ones_like(targets, dtype=torch.bool) if labels.regression else targets < labels.size
            if known.any():
                loss_sum += float(task_loss(logits[known], targets[known], labels.regression, "sum"))
                loss_n += int(known.sum())
            out = logits.squeeze(-1) if labels.regression else logits.argmax(-1)
            p, t = accelerator.gather_for_metrics((out, targets))
            preds += p.tolist()
            trues += t.tolist()
    model.train()
    totals = accelerator.reduce(torch.tensor([loss_sum, loss_n], device=accelerator.device), "sum").tolist()
    out = regression_metrics(trues, preds) if labels.regression else classification_metrics(trues, preds)
    out["loss"] = totals[0] / totals[1] if totals[1] else None
    return out


def headline_keys(m: dict[str, Any]) -> tuple[str, ...]:
    """The headline metrics of one split's evaluation (classification or regression)."""
    return REGRESSION_KEYS if "spearman" in m else CLASSIFICATION_KEYS


def log_view(prefix: str, m: dict[str, Any]) -> dict[str, Any]:
    """The metrics.jsonl fields of one split's evaluation: ``<prefix>/loss`` and the headline metrics."""
    return {f"{prefix}/{k}": m[k] for k in headline_keys(m)}


def metrics_line(m: dict[str, Any]) -> str:
    """One split's headline metrics for a console line."""
    if "spearman" in m:
        return f"Pearson {fmt(m['pearson'])}, Spearman {fmt(m['spearman'])}, MSE {fmt(m['mse'])}"
    return f"accuracy {fmt(m['accuracy'])}, macro-F1 {fmt(m['macro_f1'])}, MCC {fmt(m['mcc'])}"


def named_metrics(m: dict[str, Any], names: dict[int, str]) -> dict[str, Any]:
    """Metrics with per-class F1 keyed by label name (``unseen:<label>`` for labels train never had)."""
    out = dict(m)
    if "per_class_f1" in m:
        out["per_class_f1"] = {names[c]: v for c, v in m["per_class_f1"].items()}
    return out


def selection_key(regression: bool) -> str:
    """What best-model selection compares: macro-F1, or for a regression head Spearman's correlation
    (the STS-B figure the GLUE average takes)."""
    return "spearman" if regression else "macro_f1"


class BestValidation:
    """The best validation so far (by ``key``: :func:`selection_key`) and, with ``select_best``, a CPU
    copy of its weights.

    Registered with Accelerate for checkpointing, so a resumed run selects from the whole run.
    """

    def __init__(self, keep_weights: bool, key: str = "macro_f1"):
        self.keep_weights = keep_weights
        self.key = key
        self.step: int | None = None
        self.metrics: dict[str, Any] | None = None
        self.weights: dict[str, torch.Tensor] | None = None
        self.last_eval_step = -1

    def offer(self, step: int, metrics: dict[str, Any], model: Any) -> None:
        if self.metrics is None or _better(metrics[self.key], self.metrics[self.key]):
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


def _better(new: float | None, old: float | None) -> bool:
    """Whether ``new`` beats ``old`` (a missing number never does, and loses to any number)."""
    if new is None or (isinstance(new, float) and math.isnan(new)):
        return False
    return old is None or (isinstance(old, float) and math.isnan(old)) or new > old


def fmt(v: float | None) -> str:
    """A metric for a console line: four decimals, or n/a."""
    return "n/a" if v is None else f"{v:.4f}"
