"""Loss curves read from a run's ``metrics.jsonl``, and the live parity callback of a pretraining run
(``train.callbacks=[...,parity]``): its smoothed MLM loss against a reference run's at every step.

The sweep's pass / warn / fail verdict over whole curves is :mod:`bert_mp.sweep.parity`.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bert_mp.core.storage.files import read_jsonl
from bert_mp.errors import ConfigError

log = logging.getLogger(__name__)

TRAIN_KEYS = ("loss/mlm", "loss/nsp")
"""Per-step losses compared (smoothed) against the reference."""
EVAL_LOSS_KEYS = ("eval/loss_mlm", "eval/loss_nsp")
"""Per-evaluation losses compared against the reference."""
EVAL_ACC_KEYS = ("eval/accuracy_mlm", "eval/accuracy_nsp")
"""Final evaluation accuracies, reported as absolute deltas (not part of the verdict)."""
STALL_KEY = "bf16/update_efficiency"
"""bf16_pure: the share of each optimizer update that reached the bf16 weights (core/numerics/bf16_updates.py)."""


@dataclass
class Curves:
    """The metrics of one run: per key, the (step, value) pairs of train and eval lines."""

    train: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    eval: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def series(self, kind: str, key: str) -> list[tuple[int, float]]:
        return (self.train if kind == "train" else self.eval).get(key, [])


def _as_float(v: Any) -> float:
    # A null loss means the loop could not produce a number; treat it like NaN rather than skip it.
    return float("nan") if v is None else float(v)


def curves_from_rows(rows: Sequence[dict]) -> Curves:
    """Group metrics.jsonl rows by kind and key. A step logged twice (after a resume) keeps the last."""
    by_kind: dict[str, dict[str, dict[int, float]]] = {"train": {}, "eval": {}}
    for row in rows:
        kind = row.get("kind")
        if kind not in by_kind or "step" not in row:
            continue
        keys = TRAIN_KEYS + ("loss/total", STALL_KEY) if kind == "train" else EVAL_LOSS_KEYS + EVAL_ACC_KEYS
        for key in keys:
            # a null NSP metric means no NSP labels (objective=mlm): no curve, the check is n/a
            if key in row and not (row[key] is None and "nsp" in key):
                by_kind[kind].setdefault(key, {})[int(row["step"])] = _as_float(row[key])
    return Curves(
        train={k: sorted(v.items()) for k, v in by_kind["train"].items()},
        eval={k: sorted(v.items()) for k, v in by_kind["eval"].items()},
    )


def load_curves(run_dir: str | Path) -> Curves:
    """Read ``<run_dir>/metrics.jsonl`` (or a metrics.jsonl path) into curves."""
    p = Path(run_dir)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not p.is_file():
        raise ConfigError(f"no metrics.jsonl at {p}: not a bert_mp run folder")
    return curves_from_rows(list(read_jsonl(p)))


class ParityCallback:
    """Live parity against a reference ``metrics.jsonl`` (``train.parity_reference``) in any run.

    At every step it logs ``parity/mlm_abs_dev`` and ``parity/mlm_rel_dev`` (smoothed over
    ``sweep.parity_window`` steps, relative to the reference at the same step); when the relative
    deviation exceeds ``train.parity_tolerance`` it warns once per excursion, or with
    ``train.parity_action=stop`` asks the loop to save and stop. The end summary gets a ``parity`` block.
    A :class:`bert_mp.core.loop.callbacks.Callback`; it reads the logged loss, not the step's facts.
    """

    name = "parity"

    def __init__(self, cfg: Any):
        tcfg = cfg.train
        if not tcfg.parity_reference:
            raise ConfigError(
                "the parity callback needs train.parity_reference=<reference metrics.jsonl or run folder>"
            )
        self.reference_path = str(tcfg.parity_reference)
        self.tolerance = float(tcfg.parity_tolerance)
        self.action = tcfg.parity_action
        self.window = int(getattr(getattr(cfg, "sweep", None), "parity_window", 20))
        self._ref_mlm: dict[int, float] = {}
        self._ref_eval: dict[int, float] = {}
        self._run_buf: deque[float] = deque(maxlen=self.window)
        self._ref_buf: deque[float] = deque(maxlen=self.window)
        self._outside = False
        self._max_rel = 0.0
        self._steps_outside = 0
        self._first_outside: int | None = None
        self._compared = 0
        self._eval_dev: list[dict[str, float]] = []

    def on_train_start(self, state: Any, ctx: Any = None) -> None:
        ref = load_curves(self.reference_path)
        self._ref_mlm = dict(ref.series("train", "loss/mlm"))
        self._ref_eval = dict(ref.series("eval", "eval/loss_mlm"))
        if not self._ref_mlm:
            raise ConfigError(
                f"train.parity_reference {self.reference_path}: no train loss/mlm lines to compare to"
            )

    def on_step_end(self, state: Any, facts: Any, logs: dict) -> None:
        step = int(logs.get("step", getattr(state, "step", -1)))
        value = logs.get("loss/mlm")
        if value is None or step not in self._ref_mlm:
            return
        self._run_buf.append(float(value))
        self._ref_buf.append(self._ref_mlm[step])
        run_s = sum(self._run_buf) / len(self._run_buf)
        ref_s = sum(self._ref_buf) / len(self._ref_buf)
        d_abs = run_s - ref_s
        d_rel = abs(d_abs) / abs(ref_s) if ref_s != 0 else math.inf
        if not math.isfinite(run_s):
            d_rel = math.inf
        logs["parity/mlm_abs_dev"] = d_abs
        logs["parity/mlm_rel_dev"] = d_rel
        self._compared += 1
        self._max_rel = max(self._max_rel, d_rel)
        if d_rel > self.tolerance:
            self._steps_outside += 1
            if self._first_outside is None:
                self._first_outside = step
            if not self._outside:
                log.warning(
                    "parity: step %d smoothed MLM loss %.4g is %.1f%% from the reference %.4g (tolerance %.1f%%)",
                    step,
                    run_s,
                    100 * d_rel,
                    ref_s,
                    100 * self.tolerance,
                )
            self._outside = True
            if self.action == "stop":
                state.stop_reason = (
                    f"parity: smoothed MLM loss {d_rel:.1%} from the reference at step {step} "
                    f"(tolerance {self.tolerance:.1%})"
                )
        else:
            self._outside = False

    def on_eval_end(self, state: Any, logs: dict) -> None:
        step = int(logs.get("step", getattr(state, "step", -1)))
        value = logs.get("eval/loss_mlm")
        ref = self._ref_eval.get(step)
        if value is None or ref is None or ref == 0:
            return
        rel = (float(value) - ref) / abs(ref)
        logs["parity/eval_mlm_rel_dev"] = rel
        self._eval_dev.append({"step": step, "rel_dev": rel})

    _STATE = ("_outside", "_max_rel", "_steps_outside", "_first_outside", "_compared", "_eval_dev")

    def state_dict(self) -> dict:
        """The smoothing windows and the excursion record, so a resumed run judges the whole run."""
        d = {k.lstrip("_"): getattr(self, k) for k in self._STATE}
        return {**d, "run_buf": list(self._run_buf), "ref_buf": list(self._ref_buf)}

    def load_state_dict(self, d: dict) -> None:
        for k in self._STATE:
            setattr(self, k, d[k.lstrip("_")])
        self._run_buf.extend(d["run_buf"])
        self._ref_buf.extend(d["ref_buf"])

    def on_train_end(self, state: Any, summary: dict) -> None:
        summary["parity"] = {
            "reference": self.reference_path,
            "tolerance": self.tolerance,
            "action": self.action,
            "window": self.window,
            "steps_compared": self._compared,
            "max_mlm_rel_dev": self._max_rel if self._compared else None,
            "steps_outside_tolerance": self._steps_outside,
            "first_step_outside": self._first_outside,
            "eval": self._eval_dev,
        }
