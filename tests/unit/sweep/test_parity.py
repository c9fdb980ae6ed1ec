import math

import pytest
from support import PARITY_STEPS, synthetic_rows

from bert_mp.pretrain.parity_monitor import curves_from_rows
from bert_mp.sweep.parity import VerdictRules, deviation, first_nonfinite, moving_average, verdict


@pytest.fixture
def ref():
    return curves_from_rows(synthetic_rows(noise=0.01, seed=1))


@pytest.fixture
def spread():
    # another fp32 seed: about 1% step noise and a 1.5% offset
    return curves_from_rows(synthetic_rows(scale=1.015, noise=0.01, seed=2))


RULES = VerdictRules(window=10)


def test_moving_average_is_trailing():
    assert moving_average([1, 3, 5, 7], 2) == [1, 2, 4, 6]
    assert math.isnan(moving_average([1, float("nan"), 5], 2)[2])


def test_deviation_aligns_on_common_steps():
    d = deviation([(1, 2.0), (2, 4.0), (3, 6.0)], [(2, 2.0), (3, 3.0), (4, 1.0)])
    assert d.steps == [2, 3]
    assert d.abs == [2.0, 3.0] and d.rel == [1.0, 1.0]
    assert d.summary()["max_rel"] == 1.0


def test_same_curve_passes_with_zero_deviation(ref, spread):
    v = verdict(ref, ref, spread, RULES)
    assert v.status == "pass"
    assert v.checks["train:loss/mlm"]["value"] == 0.0
    assert v.checks["train:loss/mlm"]["seed_spread"] > 0.005


def test_small_precision_noise_passes(ref, spread):
    bf16 = curves_from_rows(synthetic_rows(noise=0.01, seed=3))
    v = verdict(bf16, ref, spread, RULES)
    assert v.status == "pass", v.reasons


def test_offset_between_warn_and_fail_warns(ref, spread):
    # the seed spread is ~1.5%; a 4.5% offset is 3x: above warn (2x), below fail (5x)
    run = curves_from_rows(synthetic_rows(scale=1.045, noise=0.01, seed=1))
    v = verdict(run, ref, spread, RULES)
    assert v.status == "warn", v.checks
    assert 2 < v.checks["train:loss/mlm"]["ratio"] <= 5


def test_large_offset_must_fail(ref, spread):
    run = curves_from_rows(synthetic_rows(scale=1.15, noise=0.01, seed=1))
    v = verdict(run, ref, spread, RULES)
    assert v.status == "fail"
    assert v.checks["train:loss/mlm"]["status"] == "fail"
    assert any("train:loss/mlm" in r for r in v.reasons)


def test_nan_is_a_hard_fail(ref, spread):
    run = curves_from_rows(synthetic_rows(noise=0.01, seed=1, nan_at=150))
    assert first_nonfinite(run) == ("loss/mlm", 150)
    v = verdict(run, ref, spread, RULES)
    assert v.status == "fail"
    assert any("non-finite loss/mlm at step 150" in r for r in v.reasons)


def test_divergence_is_a_hard_fail_even_with_huge_tolerances(ref, spread):
    run = curves_from_rows(synthetic_rows(noise=0.01, seed=1, blowup_from=180))
    lenient = VerdictRules(window=10, warn_multiplier=1e6, fail_multiplier=1e6)
    v = verdict(run, ref, spread, lenient)
    assert v.status == "fail"
    assert any(r.startswith("diverged") for r in v.reasons)


def test_incomplete_run_fails(ref, spread):
    assert verdict(ref, ref, spread, RULES, run_status="failed").status == "fail"


def test_without_second_seed_uses_floor(ref):
    run = curves_from_rows(synthetic_rows(scale=1.004, seed=1, noise=0.01))
    v = verdict(run, ref, None, RULES)
    assert v.checks["train:loss/mlm"]["tolerance"] == RULES.min_spread
    assert any("min_spread" in r for r in v.reasons)


def test_resumed_run_keeps_last_value_per_step():
    rows = synthetic_rows()
    rows.append({"step": 5, "kind": "train", "loss/mlm": 1.0, "loss/nsp": 0.5, "loss/total": 1.5})
    c = curves_from_rows(rows)
    assert dict(c.series("train", "loss/mlm"))[5] == 1.0
    assert len(c.series("train", "loss/mlm")) == PARITY_STEPS
