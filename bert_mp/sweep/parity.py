"""Loss parity between a precision and the fp32 reference, and the pass / warn / fail verdict.

Everything here is a pure function of loss curves (:mod:`bert_mp.pretrain.parity_monitor` reads them), so the verdict rules can
be tested with synthetic curves. Tolerances are not absolute numbers: they are multiples of the
natural seed-to-seed spread of fp32 (the same recipe trained with a second seed), because a
precision that moves the loss less than a different seed does is as good as fp32.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bert_mp.core.config import SweepConfig
from bert_mp.pretrain.parity_monitor import (
    EVAL_ACC_KEYS,
    EVAL_LOSS_KEYS,
    STALL_KEY,
    TRAIN_KEYS,
    Curves,
)

VERDICT_CHECKS = (
    ("train", "loss/mlm"),
    ("train", "loss/nsp"),
    ("eval", "eval/loss_mlm"),
    ("eval", "eval/loss_nsp"),
)
"""The deviations that decide the verdict, each compared against its own seed spread."""
VERDICTS = ("pass", "warn", "fail")
MIN_UPDATE_EFFICIENCY = 0.5
"""Below this mean share the run is judged stalled: updates round away in bf16."""


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` points (fewer at the start); a NaN stays visible in its window."""
    out: list[float] = []
    buf: deque[float] = deque(maxlen=window)
    for v in values:
        buf.append(v)
        out.append(sum(buf) / len(buf))
    return out


@dataclass
class Deviation:
    """Run minus reference on the steps both logged: absolute and relative (to the reference)."""

    steps: list[int]
    run: list[float]
    ref: list[float]
    abs: list[float]
    rel: list[float]

    def summary(self) -> dict[str, float | None]:
        """Mean, max and final |relative deviation|, plus final absolute deviation."""
        if not self.steps:
            return {"mean_rel": None, "max_rel": None, "final_rel": None, "final_abs": None, "points": 0}
        rel = [abs(r) for r in self.rel]
        return {
            "mean_rel": sum(rel) / len(rel),
            "max_rel": max(rel),
            "final_rel": rel[-1],
            "final_abs": self.abs[-1],
            "points": len(rel),
        }


def deviation(
    run: Sequence[tuple[int, float]], ref: Sequence[tuple[int, float]], window: int = 1
) -> Deviation:
    """Smooth both series over ``window`` steps, then compare them on their common steps."""
    run_s = dict(zip([s for s, _ in run], moving_average([v for _, v in run], window)))
    ref_s = dict(zip([s for s, _ in ref], moving_average([v for _, v in ref], window)))
    steps = sorted(set(run_s) & set(ref_s))
    a = [run_s[s] for s in steps]
    b = [ref_s[s] for s in steps]
    d_abs = [x - y for x, y in zip(a, b)]
    d_rel = [d / abs(y) if y != 0 else math.inf for d, y in zip(d_abs, b)]
    return Deviation(steps=steps, run=a, ref=b, abs=d_abs, rel=d_rel)


def first_nonfinite(curves: Curves) -> tuple[str, int] | None:
    """The first (key, step) whose loss is NaN or inf, or None when every logged loss is finite."""
    hits = []
    for kind in ("train", "eval"):
        src = curves.train if kind == "train" else curves.eval
        for key, pts in src.items():
            if not key.startswith(("loss/", "eval/loss")):
                continue
            for step, v in pts:
                if not math.isfinite(v):
                    hits.append((step, key))
                    break
    if not hits:
        return None
    step, key = min(hits)
    return key, step


def compare(run: Curves, ref: Curves, window: int) -> dict[str, dict[str, Any]]:
    """Deviation summaries of every compared metric: smoothed per-step losses and per-eval losses.

    Keys are ``"train:loss/mlm"`` etc. Final-eval accuracies are reported as ``abs_delta``.
    """
    out: dict[str, dict[str, Any]] = {}
    for key in TRAIN_KEYS:
        out[f"train:{key}"] = deviation(run.series("train", key), ref.series("train", key), window).summary()
    for key in EVAL_LOSS_KEYS:
        out[f"eval:{key}"] = deviation(run.series("eval", key), ref.series("eval", key), 1).summary()
    for key in EVAL_ACC_KEYS:
        a, b = run.series("eval", key), ref.series("eval", key)
        out[f"eval:{key}"] = {"abs_delta": (a[-1][1] - b[-1][1]) if a and b else None}
    return out


@dataclass
class VerdictRules:
    """Tolerances as multiples of the fp32 seed-to-seed spread, plus the hard-failure threshold.

    The defaults are the ``sweep`` section's (one definition, documented there)."""

    window: int = SweepConfig.parity_window
    warn_multiplier: float = SweepConfig.warn_multiplier
    fail_multiplier: float = SweepConfig.fail_multiplier
    min_spread: float = SweepConfig.min_spread
    divergence_rel: float = SweepConfig.divergence_rel

    @classmethod
    def from_sweep(cls, sweep_cfg: Any) -> VerdictRules:
        return cls(
            window=sweep_cfg.parity_window,
            warn_multiplier=sweep_cfg.warn_multiplier,
            fail_multiplier=sweep_cfg.fail_multiplier,
            min_spread=sweep_cfg.min_spread,
            divergence_rel=sweep_cfg.divergence_rel,
        )


def _metric_value(kind: str, summary: dict[str, Any]) -> float | None:
    # Per-step curves: the mean over training (a single noisy step should not decide);
    # evaluations: the final one (what the user will fine-tune from).
    return summary.get("mean_rel") if kind == "train" else summary.get("final_rel")


@dataclass
class Verdict:
    """The outcome for one precision: status, why, and each check's deviation / tolerance ratio."""

    status: str
    reasons: list[str]
    checks: dict[str, dict[str, Any]]
    comparison: dict[str, dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def verdict(
    run: Curves,
    ref: Curves,
    spread: Curves | None,
    rules: VerdictRules,
    run_status: str = "completed",
) -> Verdict:
    """Pass / warn / fail for ``run`` against the fp32 ``ref``; ``spread`` is fp32 with another seed.

    - fail outright: the run did not complete, logged a NaN/inf loss, or its smoothed MLM loss left
      the reference by more than ``divergence_rel`` at any step (divergence);
    - otherwise each check (mean smoothed train MLM / NSP loss deviation, final eval MLM / NSP loss
      deviation) is divided by its tolerance ``max(seed spread, min_spread)``: every ratio
      <= warn_multiplier passes, any ratio > fail_multiplier fails, anything between warns.
    """
    reasons: list[str] = []
    comparison = compare(run, ref, rules.window)
    spread_cmp = compare(spread, ref, rules.window) if spread is not None else None
    hard_fail = False
    if run_status != "completed":
        hard_fail = True
        reasons.append(f"run status is {run_status!r}, not 'completed'")
    bad = first_nonfinite(run)
    if bad is not None:
        hard_fail = True
        reasons.append(f"non-finite {bad[0]} at step {bad[1]}")
    mlm = deviation(run.series("train", "loss/mlm"), ref.series("train", "loss/mlm"), rules.window)
    finite_rel = [(s, abs(r)) for s, r in zip(mlm.steps, mlm.rel) if math.isfinite(r)]
    over = [(s, r) for s, r in finite_rel if r > rules.divergence_rel]
    if over:
        hard_fail = True
        s, r = over[0]
        reasons.append(
            f"diverged: smoothed MLM loss {r:.0%} away from fp32 at step {s} (limit {rules.divergence_rel:.0%})"
        )
    if not mlm.steps:
        hard_fail = True
        reasons.append("no training steps in common with the fp32 reference")
    stall = stall_reason(run)
    if stall:
        hard_fail = True
        reasons.append(stall)

    checks: dict[str, dict[str, Any]] = {}
    worst = "pass"
    for kind, key in VERDICT_CHECKS:
        name = f"{kind}:{key}"
        seed = _metric_value(kind, spread_cmp[name]) if spread_cmp is not None else None
        checks[name] = check_deviation(name, _metric_value(kind, comparison[name]), seed, rules, reasons)
        status = checks[name]["status"]  # "n/a": no such metric (NSP with objective=mlm)
        if status in VERDICTS and VERDICTS.index(status) > VERDICTS.index(worst):
            worst = status
    if spread is None:
        reasons.append(f"no second fp32 seed: tolerances use the floor min_spread={rules.min_spread:g}")
    return Verdict(
        status="fail" if hard_fail else worst, reasons=reasons, checks=checks, comparison=comparison
    )


def stall_reason(run: Curves) -> str | None:
    """Why a bf16_pure run stalled (its updates rounded away), or None: the mean of
    ``bf16/update_efficiency`` below :data:`MIN_UPDATE_EFFICIENCY`. A loss curve can hide a stall
    for a while; the measured share of the update that reached the weights cannot."""
    eff = [v for _, v in run.series("train", STALL_KEY) if math.isfinite(v)]
    if not eff or sum(eff) / len(eff) >= MIN_UPDATE_EFFICIENCY:
        return None
    mean = sum(eff) / len(eff)
    return (
        f"stalled: on average {mean:.0%} of each optimizer update reached the bf16 weights "
        f"(limit {MIN_UPDATE_EFFICIENCY:.0%}); use train.bf16_update=kahan or stochastic"
    )


def check_deviation(
    name: str, value: float | None, seed: float | None, rules: VerdictRules, reasons: list[str]
) -> dict:
    """One check: its deviation over the tolerance ``max(seed spread, min_spread)``, and a reason
    appended when it does not pass. The sweep's downstream verdict (:mod:`bert_mp.sweep.downstream`)
    judges fine-tuned metrics against the fp32 band with it too."""
    if value is None:
        return {"value": None, "seed_spread": seed, "tolerance": None, "ratio": None, "status": "n/a"}
    tol = max(seed if seed is not None and math.isfinite(seed) else 0.0, rules.min_spread)
    ratio = value / tol if math.isfinite(value) else math.inf
    status = (
        "pass" if ratio <= rules.warn_multiplier else ("warn" if ratio <= rules.fail_multiplier else "fail")
    )
    if status != "pass" and math.isfinite(value):
        reasons.append(
            f"{name} deviates {value:.2%} = {ratio:.1f}x the tolerance {tol:.2%} "
            f"(warn > {rules.warn_multiplier:g}x, fail > {rules.fail_multiplier:g}x)"
        )
    return {"value": value, "seed_spread": seed, "tolerance": tol, "ratio": ratio, "status": status}
