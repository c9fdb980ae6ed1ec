"""Runs that should be equally fast are compared: the whole `bert-mp sweep` command (plan, runs, report,
console) with each run's process replaced by one that writes the run folder a real run writes, with
the step times, load and subnormal floats a test injects. So the check is tested under a loaded
machine, and under subnormal slow-downs, without loading this machine or waiting for a slow run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from support import ROOT

from bert_mp.cli import main
from bert_mp.core.storage.files import atomic_write_json
from bert_mp.errors import HardwareError
from bert_mp.sweep import runner

STEPS = 20
IDLE = {"others_cpu_cores": 0.05, "load_start": [0.3, 0.2, 0.1], "load_end": [0.9, 0.4, 0.2]}
LOADED = {"others_cpu_cores": 1.9, "load_start": [0.9, 0.5, 0.3], "load_end": [3.9, 1.6, 0.7]}


def conditions(**over) -> dict:
    c = {
        "threads": 2,
        "threads_source": "2 cores // 1 process",
        "interop_threads": 2,
        "thread_env": {},
        "processes": 1,
        "local_processes": 1,
        "cores": 2,
        "cpu_model": "Test CPU 9000",
        "gpu": None,
        "flush_denormal": "off",
        "subnormal_share": 0.0,
        **IDLE,
    }
    c.update(over)
    return c


class FakeRuns:
    """Stands in for the run processes: writes each run's metrics.jsonl and summary.json as
    `bert-mp train` does, with the step time and conditions set for that run's name."""

    def __init__(self) -> None:
        self.step_ms: dict[str, float] = {}
        self.conditions: dict[str, dict] = {}
        self.trained: list[str] = []

    def __call__(self, run, cmd, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        ms = self.step_ms.get(run.name, 110.0)
        tps = 2048 * 1e3 / ms
        rows = [
            {
                "step": s,
                "kind": "train",
                "loss/total": 8.6 - math.log(s),
                "loss/mlm": 8.0 - math.log(s) * (1.01 if run.role == "seed_spread" else 1.0),
                "loss/nsp": 0.6,
                "time/step_ms": ms,
                "throughput/tokens_per_sec": tps,
            }
            for s in range(1, STEPS + 1)
        ]
        final = {
            "eval/loss_mlm": 5.0,
            "eval/loss_nsp": 0.6,
            "eval/accuracy_mlm": 0.3,
            "eval/accuracy_nsp": 0.6,
        }
        rows.append({"step": STEPS, "kind": "eval", **final})
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        summary = {
            "status": "completed",
            "steps": STEPS,
            "precision": {"name": run.precision, "device": "cpu", "device_name": "Test CPU 9000"},
            "versions": {"torch": "9.9"},
            "final_eval": final,
            "throughput": {"tokens_per_sec": tps, "step_ms": ms, "mfu": None},
            "conditions": self.conditions.get(run.name, conditions()),
        }
        atomic_write_json(run_dir / "summary.json", summary)
        run.wall_s, run.cpu_s, run.returncode, run.status = STEPS * ms / 1e3, 1.0, 0, "completed"
        self.trained.append(run.name)


@pytest.fixture
def fake(monkeypatch) -> FakeRuns:
    from bert_mp.core.numerics import precision

    def resolve(name, device, *a, **k):
        if name == "fp16":  # as on a CPU without fp16, on every machine
            raise HardwareError("train.precision=fp16 on CPU needs native fp16 (simulated for this test)")
        return None

    runs = FakeRuns()
    monkeypatch.setattr(runner, "_execute", runs)
    monkeypatch.setattr(runner.Sweep, "_prepare_data", lambda self, cfgs: None)
    monkeypatch.setattr(precision, "resolve_precision", resolve)
    monkeypatch.chdir(ROOT)
    return runs


def sweep(tmp_path: Path, *extra: str) -> int:
    return main(
        [
            "sweep",
            "configs/quickstart_sweep.yaml",
            f"sweep.output_dir={tmp_path / 'sweep'}",
            "sweep.profile_steps=0",
            "sweep.parity_window=2",
            *extra,
        ]
    )


def _summary(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "sweep" / "summary.json").read_text())["groups"][0]


WITHHELD = (
    "speed-ups withheld: fp32 (111.7 ms/step) and fp32-seed43 (1100.0 ms/step) should run equally fast but "
    "differ 9.85x, beyond the 15% noise bound; likely cause: other work loaded the machine during "
    "fp32-seed43 (other processes used 1.9 of 2 cores on average)"
)


def test_a_second_fp32_seed_slowed_by_other_work_withholds_every_speed_up(tmp_path, fake, capsys):
    """The loaded-machine case: busy loops on both cores during the second fp32 seed only."""
    fake.step_ms.update({"fp32": 111.7, "fp32-seed43": 1100.0, "bf16": 100.0})
    fake.conditions["fp32-seed43"] = conditions(**LOADED)
    assert sweep(tmp_path) == 0
    out = capsys.readouterr().out
    # the console: the run's own load line as it ends, the verdicts without a speed-up, the check's line
    assert (
        "[2/4] runs/fp32-seed43: warning: other processes used 1.9 of 2 cores on average while it ran" in out
    )
    bf16 = next(line for line in out.splitlines() if line.strip().startswith("bf16 "))
    assert "speed withheld (see below)" in bf16 and "x fp32 speed" not in out
    assert f"  {WITHHELD}" in out.splitlines()
    assert (
        "  load: fp32-seed43: other processes used 1.9 of 2 cores on average while it ran (load average 0.90 -> 3.90)"
        in out
    )
    # the report: the line, and a ladder with every run (both seeds) and no speed-up
    md = (tmp_path / "sweep" / "report.md").read_text()
    assert f"**{WITHHELD}.**" in md
    assert "| fp32-seed43 | fp32 | 1100.0 | 1862 | withheld (see above) |" in md
    assert "| bf16 | bf16 | 100.0 | 20480 | withheld (see above) |" in md
    assert "Load the runs met: fp32-seed43: other processes used 1.9 of 2 cores" in md
    assert "Throughput (speed-ups withheld: see the speed ladder)" in md
    group = _summary(tmp_path)
    ladder = {r["name"]: r for r in group["speed_ladder"]}
    assert set(ladder) == {"fp32", "fp32-seed43", "bf16"}
    assert all(r["speedup_vs_fp32"] is None and r["withheld"] for r in ladder.values())
    assert group["speed_checks"][0]["withholds"] and group["speed_checks"][0]["kind"] == "seeds"


def test_seeds_that_agree_let_the_speed_ups_through(tmp_path, fake, capsys):
    fake.step_ms.update({"fp32": 110.0, "fp32-seed43": 118.0, "bf16": 100.0})
    assert sweep(tmp_path) == 0
    out = capsys.readouterr().out
    assert "1.10x fp32 speed" in out and "withheld" not in out and "load:" not in out
    md = (tmp_path / "sweep" / "report.md").read_text()
    line = "Equal-speed check: fp32 (110.0 ms/step) and fp32-seed43 (118.0 ms/step) agree within 7% (noise bound 15%)."
    assert line in md
    assert "| fp32-seed43 | fp32 | 118.0 | 17356 | 0.93x |" in md
    # a tighter bound, set on the command line, withholds the same figures
    assert sweep(tmp_path, "sweep.speed_noise=0.05") == 0
    assert (
        "speed-ups withheld: fp32 (110.0 ms/step) and fp32-seed43 (118.0 ms/step)" in capsys.readouterr().out
    )


def test_subnormal_floats_are_named_where_the_fp32_run_shows_them(tmp_path, fake, capsys):
    fake.step_ms.update({"fp32": 160.0, "fp32-seed43": 1580.0})
    fake.conditions["fp32-seed43"] = conditions(subnormal_share=0.12)
    assert sweep(tmp_path) == 0
    out = capsys.readouterr().out
    assert (
        "likely cause: subnormal floats: 12.0% of fp32-seed43's weights and optimizer state were subnormal at its "
        "end, which the CPU computes with tens of times slower (hardware.flush_denormal=true flushes them)"
    ) in out
    # neither load nor subnormals recorded: said so, with the command that measures again
    fake.conditions["fp32-seed43"] = conditions()
    assert sweep(tmp_path, "sweep.rerun=[fp32-seed43]") == 0
    out = capsys.readouterr().out
    assert "likely cause: nothing recorded: neither run met other work or left subnormal floats" in out
    assert "(sweep.rerun=[fp32,fp32-seed43])" in out


def test_a_rerun_is_compared_with_its_earlier_measurement(tmp_path, fake, capsys):
    """A run measured under load, trained again on an idle machine: the rerun replaces it and the
    speed-ups return; a rerun that disagrees with an earlier idle measurement withholds them."""
    fake.step_ms.update({"fp32": 110.0, "fp32-seed43": 1100.0, "bf16": 100.0})
    fake.conditions["fp32-seed43"] = conditions(**LOADED)
    assert sweep(tmp_path) == 0
    capsys.readouterr()
    fake.step_ms["fp32-seed43"], fake.conditions["fp32-seed43"] = 112.0, conditions()
    assert sweep(tmp_path, "sweep.rerun=[fp32-seed43]") == 0
    out = capsys.readouterr().out
    assert fake.trained.count("fp32-seed43") == 2 and fake.trained.count("bf16") == 1  # the rest kept
    assert "1.10x fp32 speed" in out and "withheld" not in out
    checks = {c["kind"]: c for c in _summary(tmp_path)["speed_checks"]}
    assert checks["seeds"]["agree"] and checks["rerun"]["superseded"] and not checks["rerun"]["withholds"]
    md = (tmp_path / "sweep" / "report.md").read_text()
    assert (
        "Rerun: fp32-seed43 measured again: 112.0 ms/step, against 1100.0 ms/step earlier; the earlier measurement "
        "met other work (other processes used 1.9 of 2 cores on average), this one did not: the rerun replaces the "
        "earlier measurement."
    ) in md

    fake.step_ms["bf16"] = 200.0  # bf16 measured again, idle both times, at half its speed
    assert sweep(tmp_path, "sweep.rerun=[bf16]") == 0
    out = capsys.readouterr().out
    assert (
        "speed-ups withheld: bf16 (earlier) (100.0 ms/step) and bf16 (200.0 ms/step) should run equally fast "
        "but differ 2.00x"
    ) in out
    runs = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["runs"]
    assert next(r for r in runs if r["name"] == "bf16")["earlier"][0]["step_ms"] == 100.0


def test_a_skip_reason_the_sweep_meets_again_is_said_once(tmp_path, fake, capsys):
    assert sweep(tmp_path, "sweep.seeds=[42,44]", "sweep.reference_seed=null") == 0
    out = capsys.readouterr().out
    assert out.count("needs native fp16 (simulated for this test)") == 1
    assert "runs/s44/fp16: skipped: as runs/s42/fp16" in out


def test_runs_measured_with_other_threads_are_not_compared_for_noise(tmp_path, fake, capsys):
    """Two fp32 seeds run with 1 and 2 threads are not expected to run equally fast: the pair is said
    to be not compared, nothing is withheld for it, and the seed's own speed-up is not quoted."""
    fake.step_ms.update({"fp32": 110.0, "fp32-seed43": 200.0, "bf16": 100.0})
    fake.conditions["fp32-seed43"] = conditions(threads=1, threads_source="OMP_NUM_THREADS=1")
    assert sweep(tmp_path) == 0
    out = capsys.readouterr().out
    assert (
        "fp32 (110.0 ms/step) and fp32-seed43 (200.0 ms/step) were measured under other conditions "
        "(threads 1 vs 2): not compared"
    ) in out
    assert "1.10x fp32 speed" in out and "speed-ups withheld" not in out
    seed = next(line for line in out.splitlines() if line.strip().startswith("fp32-seed43 "))
    assert "speed not compared (run conditions differ" in seed
