"""The live parity callback: the smoothed MLM loss against a reference run's at every step."""

import json
from types import SimpleNamespace

import pytest
from support import synthetic_rows

from bert_mp.core.config import load_config
from bert_mp.errors import ConfigError
from bert_mp.pretrain.parity_monitor import ParityCallback, load_curves


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
