import json
import math
import random
from types import SimpleNamespace

import pytest

from bert_mp.core.config import load_config
from bert_mp.core.loop.parity import (
    ParityCallback,
    VerdictRules,
    curves_from_rows,
    deviation,
    first_nonfinite,
    load_curves,
    moving_average,
    verdict,
)
from bert_mp.errors import ConfigError

STEPS = 200


def _base(step: int) -> tuple[float, float]:
    return 2.0 + 6.0 * math.exp(-step / 60), 0.45 + 0.25 * math.exp(-step / 80)


def synthetic_rows(scale=1.0, noise=0.0, seed=0, nan_at=None, blowup_from=None, evals=(100, 200)):
    """metrics.jsonl rows following the run-folder contract, with controlled deviations."""
    rng = random.Random(seed)
    rows = []
    for step in range(1, STEPS + 1):
        mlm, nsp = _base(step)
        mlm = mlm * scale * (1 + rng.gauss(0, noise))
        nsp = nsp * scale * (1 + rng.gauss(0, noise))
        if blowup_from is not None and step >= blowup_from:
            mlm *= 1 + 0.05 * (step - blowup_from)
        if nan_at is not None and step == nan_at:
            mlm = float("nan")
        rows.append(
            {"step": step, "kind": "train", "loss/mlm": mlm, "loss/nsp": nsp, "loss/total": mlm + nsp}
        )
    for step in evals:
        mlm, nsp = _base(step)
        rows.append(
            {
                "step": step,
                "kind": "eval",
                "eval/loss_mlm": mlm * scale * (1 + rng.gauss(0, noise)),
                "eval/loss_nsp": nsp * scale * (1 + rng.gauss(0, noise)),
                "eval/accuracy_mlm": 0.3,
                "eval/accuracy_nsp": 0.6,
            }
        )
    return rows


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
    assert len(c.series("train", "loss/mlm")) == STEPS


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _cfg(ref_path, action, tolerance=0.05):
    return load_config(
        None,
        [
            f"train.parity_reference={ref_path}",
            f"train.parity_action={action}",
            f"train.parity_tolerance={tolerance}",
        ],
    )


def _drive(cb, rows):
    state = SimpleNamespace(step=0, stop_reason=None)
    cb.on_train_start(state, None)
    logged = []
    for r in rows:
        state.step = r["step"]
        logs = dict(r)
        if r["kind"] == "train":
            cb.on_step_end(state, None, logs)  # parity reads the logged loss, not the facts
        else:
            cb.on_eval_end(state, logs)
        logged.append(logs)
        if state.stop_reason:
            break
    summary: dict = {}
    cb.on_train_end(state, summary)
    return state, logged, summary


def test_callback_logs_deviation_and_stays_quiet_in_band(tmp_path):
    _write(tmp_path / "metrics.jsonl", synthetic_rows(noise=0.01, seed=1))
    cb = ParityCallback(_cfg(tmp_path, "stop"))
    state, logged, summary = _drive(cb, synthetic_rows(noise=0.01, seed=3))
    assert state.stop_reason is None
    assert all("parity/mlm_rel_dev" in row for row in logged if row["kind"] == "train")
    assert summary["parity"]["steps_outside_tolerance"] == 0
    assert summary["parity"]["max_mlm_rel_dev"] < 0.05
    assert len(summary["parity"]["eval"]) == 2


def test_callback_stops_a_run_that_leaves_the_band(tmp_path):
    _write(tmp_path / "metrics.jsonl", synthetic_rows(noise=0.01, seed=1))
    cb = ParityCallback(_cfg(tmp_path / "metrics.jsonl", "stop"))
    state, logged, summary = _drive(cb, synthetic_rows(noise=0.01, seed=1, blowup_from=120))
    assert state.stop_reason and "parity" in state.stop_reason
    assert logged[-1]["step"] == summary["parity"]["first_step_outside"] > 120


def test_callback_warn_mode_never_stops(tmp_path, caplog):
    _write(tmp_path / "metrics.jsonl", synthetic_rows(noise=0.01, seed=1))
    cb = ParityCallback(_cfg(tmp_path, "warn"))
    with caplog.at_level("WARNING"):
        state, _, summary = _drive(cb, synthetic_rows(noise=0.01, seed=1, blowup_from=120))
    assert state.stop_reason is None
    assert summary["parity"]["steps_outside_tolerance"] > 0
    # one warning per excursion, not one per step
    assert sum("parity:" in r.message for r in caplog.records) == 1


def test_callback_needs_a_reference(tmp_path):
    with pytest.raises(ConfigError, match="parity_reference"):
        ParityCallback(load_config())
    with pytest.raises(ConfigError, match="no metrics.jsonl"):
        load_curves(tmp_path)
