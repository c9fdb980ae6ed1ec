"""The kill drill: scripts/drills/fault.py against real training processes.

The fast variant here kills one run inside a checkpoint write (SIGKILL) and then with SIGTERM; the
full drill (>= 10 trials) is ``pytest -m slow`` or the script itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import load_fixture, load_script

import bert_mp.pretrain.trainer as train_mod
from bert_mp.core.checkpoint import store as ckpt
from bert_mp.core.storage.files import read_jsonl

drill = load_script("drills/fault")


def _train_in_process(cfg, prepared: Path) -> dict:
    """The drill's reference run without a process start; one thread, like the drill's children."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_mod.train(cfg, load_fixture(prepared))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.signals
# fp16 (the GradScaler state survives the kills too) under -m slow: test_optimizer_resume.py resumes an
# fp16 run bit-identically in a fresh process; the kill points are precision-blind
@pytest.mark.parametrize("precision", ["fp32", pytest.param("fp16", marks=pytest.mark.slow)])
def test_sigkill_in_checkpoint_write_then_sigterm_resume_bit_identical(tmp_path, prepared, precision):
    spec = drill.DrillSpec(max_steps=12, save_every=3, precision=precision)
    runner = drill.Runner(prepared)
    log = tmp_path / "drill.log"
    reference = tmp_path / "reference"
    _train_in_process(drill.drill_config(reference, spec, tmp_path), prepared)

    out = tmp_path / "trial"
    cfg = drill.drill_config(out, spec, tmp_path)
    fresh, resume = drill.write_run_config(cfg, resume=False), drill.write_run_config(cfg, resume=True)

    # SIGKILL while step 6's checkpoint is being written (held there after the model and optimizer
    # files, before loop_state.json): step 3's stays the newest complete one
    killed = drill.KillRecord(0, "SIGKILL", "write", 6, "state")
    drill.interrupt(runner, fresh, out, killed, log)
    assert killed.returncode == -9 and not killed.completed_before_kill
    assert killed.during_write, "the kill missed the checkpoint write"
    assert killed.resume_step == 3 and killed.logged_step == 6 and killed.steps_lost == 3
    assert "model.safetensors" in killed.partial_files
    assert ckpt.MARKER not in killed.partial_files and ckpt.LOOP_STATE not in killed.partial_files
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == ["step_00000003"]

    # SIGTERM to the run held after step 8 (of 12): it saves the step it stopped on and exits 143,
    # nothing lost; the hold makes the signal land before the run can finish, at any speed
    termed = drill.KillRecord(0, "SIGTERM", "term", 8)
    drill.interrupt(runner, resume, out, termed, log)
    assert termed.clean_exit, log.read_text()[-3000:]
    assert termed.steps_lost == 0 and termed.resume_step in (8, 9) and not termed.completed_before_kill

    runner.run(resume, log)
    assert drill.compare(reference, out) == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["precision"]["name"] == precision and summary["precision"]["loss_scaler"] == (
        precision == "fp16"
    )
    # the comparison is not vacuous: the log has every step and the eval rows
    rows = drill.loss_log(out)
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, 13))
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [4, 8, 12]


def test_compare_detects_a_one_ulp_difference(tmp_path, prepared):
    spec = drill.DrillSpec(max_steps=2, save_every=1)
    a = tmp_path / "a"
    _train_in_process(drill.drill_config(a, spec, tmp_path), prepared)
    b = tmp_path / "b"
    b.mkdir()
    (b / "final").mkdir()
    weights = load_file(str(a / "final" / "model.safetensors"))
    name = next(iter(weights))
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] = torch.nextafter(weights[name].view(-1)[0], torch.tensor(float("inf")))
    from safetensors.torch import save_file

    save_file(weights, str(b / "final" / "model.safetensors"))
    rows = list(read_jsonl(a / "metrics.jsonl"))
    (b / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert drill.compare(a, b) == [f"1 final weight tensors differ (first: {name})"]
    rows[0]["loss/total"] = float(
        torch.nextafter(
            torch.tensor(rows[0]["loss/total"], dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)
        )
    )
    (b / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert drill.compare(a, b)[0].startswith("metrics differ from row 0")


@pytest.mark.slow
@pytest.mark.signals
def test_full_fault_drill(tmp_path, prepared):
    report = drill.run_drill(tmp_path, drill.DrillSpec(trials=10, kills=2, sigterm_trials=2), prepared)
    drill.print_report(report)
    assert report["trials"] == 12 and report["mismatches"] == 0
    assert report["sigkill"]["kills"] >= 10 and report["sigkill"]["during_checkpoint_write"] >= 1
    assert report["sigkill"]["steps_lost_bound_violations"] == 0
    assert report["sigterm"]["clean_exits"] == report["sigterm"]["kills"] >= 1
    assert report["sigterm"]["steps_lost_max"] == 0
