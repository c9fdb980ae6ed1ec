"""The precision x optimizer grid of a sweep with sweep.optimizers."""

from __future__ import annotations

from types import SimpleNamespace as NS

from bert_mp.sweep.grid import grid_section, grid_summary


def _run(name, precision, role, loss, emulated=False):
    summary = NS(raw={"final_eval": {"eval/loss_mlm": loss}}, precision={"emulated": emulated})
    return NS(name=name, precision=precision, role=role, status="completed", summary=summary)


def _group(optimizer, verdicts):
    runs = [_run("fp32", "fp32", "reference", 4.0), _run("fp32-seed43", "fp32", "seed_spread", 4.1)]
    runs += [_run(p, p, "candidate", 4.2, emulated=p == "fp8") for p in verdicts]
    probe = {"measured_bytes": {"weights": 400, "gradients": 400, "optimizer_state": 800}}
    return NS(
        group=NS(name=optimizer, axes={"train.optimizer": optimizer}, runs=runs),
        verdicts={p: {"status": v} for p, v in verdicts.items()},
        ladder=[{"name": p, "speedup_vs_fp32": 1.5} for p in verdicts],
        probes={"fp32": probe, **{p: probe for p in verdicts}},
    )


def test_grid_lays_each_optimizers_verdicts_side_by_side():
    analyses = [_group("adamw", {"bf16_pure": "pass", "fp8": "warn"}), _group("lamb", {"bf16_pure": "fail"})]
    grid = grid_summary(analyses)
    assert list(grid) == ["adamw", "lamb"]
    assert grid["adamw"]["fp8"]["verdict"] == "warn" and grid["adamw"]["fp8"]["emulated"]
    assert grid["lamb"]["bf16_pure"]["verdict"] == "fail" and "fp8" not in grid["lamb"]
    assert grid["adamw"]["fp32"]["verdict"] == "reference" and grid["adamw"]["fp32"]["state_bytes"] == 1600
    assert "fp32-seed43" not in grid["adamw"] and grid["adamw"]["fp32"]["final_eval_loss_mlm"] == 4.0
    [(title, [table, _])] = grid_section(analyses, lambda h, r: (h, r), lambda b: f"{b} B")
    headers, rows = table
    assert title == "Precision x optimizer" and headers == ["precision", "adamw", "lamb"]
    assert [r[0] for r in rows] == ["fp32", "bf16_pure", "fp8"]
    assert rows[2][1].startswith("WARN; 1.50x (emulated)") and rows[2][2] == "-"


def test_no_grid_without_the_optimizer_axis():
    ga = _group("adamw", {"bf16": "pass"})
    ga.group.axes = {}
    assert grid_summary([ga]) == {} and grid_section([ga], None, None) == []
