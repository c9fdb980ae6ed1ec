"""The downstream verdict on made-up figures: the loss verdict's rule and words against the fp32 band,
withheld with the reason where the band is not measurable; and the fine-tune plan."""

import pytest

from bert_mp.sweep import parity
from bert_mp.sweep.downstream import Cell, band, plan_downstream, task_verdicts
from bert_mp.sweep.parity import VerdictRules

RULES = VerdictRules()  # warn > 2x, fail > 5x the tolerance max(band, 0.5%)


def _cell(run, role, values, statuses=None, precision=None, run_status="completed"):
    return Cell(
        run,
        precision or ("fp32" if role in ("reference", "seed_spread") else run),
        role,
        run_status,
        None,
        seeds=list(range(1, len(values) + 1)),
        statuses=statuses or ["completed"] * len(values),
        values=list(values),
        reasons=[None] * len(values),
    )


def _verdicts(*cells):
    out = task_verdicts(list(cells), RULES, "builtin-package:macro_f1")
    return out["band"], {k: v["verdict"] for k, v in out["runs"].items()}


def test_the_band_is_what_both_fp32_seeds_fine_tunes_span():
    ref = _cell("fp32", "reference", [0.50, 0.54])
    spread = _cell("fp32-seed43", "seed_spread", [0.48, 0.52])
    b, why = band([ref, spread])
    assert (
        why is None and b["min"] == 0.48 and b["max"] == 0.54 and b["reference_mean"] == pytest.approx(0.52)
    )
    assert b["rel_width"] == pytest.approx(0.06 / 0.52)


@pytest.mark.parametrize(
    "mean, status",
    [(0.52, "pass"), (0.52 * (1 + 1.9 * 0.06 / 0.52), "pass"), (0.38, "warn"), (0.20, "fail")],
)
def test_pass_warn_fail_by_the_loss_verdicts_rule(mean, status):
    ref = _cell("fp32", "reference", [0.50, 0.54])
    spread = _cell("fp32-seed43", "seed_spread", [0.48, 0.52])
    b, v = _verdicts(ref, spread, _cell("bf16", "candidate", [mean, mean]))
    assert v["bf16"]["status"] == status
    # the same numbers the loss verdict's own check gives
    same = parity.check_deviation("x", abs(mean - 0.52) / 0.52, b["rel_width"], RULES, [])
    assert v["bf16"]["check"]["ratio"] == pytest.approx(same["ratio"])
    assert v["fp32"]["status"] == "reference" and v["fp32-seed43"]["status"] == "seed spread"
    if status != "pass":
        assert "deviates" in v["bf16"]["reasons"][0]


def test_a_band_that_cannot_be_measured_withholds_the_verdict_with_the_reason():
    ref = _cell("fp32", "reference", [0.50, 0.54])
    cand = _cell("bf16", "candidate", [0.2, 0.2])
    _, v = _verdicts(ref, cand)  # no second fp32 seed
    assert v["bf16"]["status"] == "n/a" and "not measurable: no second fp32 seed" in v["bf16"]["reasons"][0]
    spread = _cell("fp32-seed43", "seed_spread", [0.5, None], statuses=["completed", "failed"])
    _, v = _verdicts(ref, spread, cand)
    assert v["bf16"]["status"] == "n/a" and "did not all complete (1 of 2)" in v["bf16"]["reasons"][0]
    zero = _cell("fp32", "reference", [0.0, 0.0])
    _, v = _verdicts(zero, _cell("fp32-seed43", "seed_spread", [0.0, 0.1]), cand)
    assert v["bf16"]["status"] == "n/a" and "mean is 0" in v["bf16"]["reasons"][0]


def test_failed_skipped_and_unfinished_candidates():
    ref = _cell("fp32", "reference", [0.5, 0.5])
    spread = _cell("fp32-seed43", "seed_spread", [0.5, 0.5])
    broken = _cell("fp16", "candidate", [0.5, None], statuses=["completed", "failed"])
    skipped = _cell("fp8", "candidate", [], run_status="skipped")
    skipped.run_reason = "fp8 needs a GPU"
    diverged = _cell("bf16_pure", "candidate", [], run_status="failed")
    half = _cell("bf16", "candidate", [0.5, None], statuses=["completed", "pending"])
    _, v = _verdicts(ref, spread, broken, skipped, diverged, half)
    assert v["fp16"]["status"] == "fail" and "fine-tune failed (seed 2: failed)" in v["fp16"]["reasons"][0]
    assert v["fp8"] == {"status": "skipped", "reasons": ["fp8 needs a GPU"], "check": None}
    assert v["bf16_pure"]["status"] == "fail" and "no checkpoint" in v["bf16_pure"]["reasons"][0]
    assert v["bf16"]["status"] == "incomplete"


def test_one_fine_tune_per_run_task_and_seed(tmp_path):
    from types import SimpleNamespace

    from bert_mp.core.config import load_config
    from bert_mp.sweep.runner import plan_sweep

    cfg = load_config(
        None,
        [
            "sweep.precisions=[fp32,bf16]",
            "sweep.seeds=[1,2]",
            "sweep.downstream.tasks=[builtin-package,glue/stsb]",
            "sweep.downstream.seeds=[5,6]",
        ],
    )
    groups = [SimpleNamespace(name=g.name, runs=g.runs) for g in plan_sweep(cfg)]
    plan = plan_downstream(groups, cfg)
    assert len(plan) == 2 * 3 * 2 * 2  # groups x runs x tasks x seeds
    first = plan[0]
    assert (first.run, first.task, first.seed) == ("fp32", "builtin-package", 5)
    assert first.dir == "downstream/s1/fp32/builtin-package-seed5"
    assert plan[3].dir == "downstream/s1/fp32/glue-stsb-seed6"
