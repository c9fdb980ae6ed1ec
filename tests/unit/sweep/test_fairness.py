"""Speed-ups are quoted only between runs measured under the same conditions (threads, load, devices)."""

import importlib.util
import json
from pathlib import Path

from bert_mp.cli import main
from bert_mp.core.io import atomic_write_json
from bert_mp.sweep import fairness


def _make_sweep(root: Path) -> Path:
    """test_report's synthetic sweep folder (fp32 reference, fp32 seed run, bf16, fp16, ...)."""
    spec = importlib.util.spec_from_file_location(
        "_report_fixture", Path(__file__).with_name("test_report.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.make_sweep(root)


def cond(threads=2, others=0.1, load=(0.3, 0.2, 0.1), processes=1, cores=2, cpu="Test CPU 9000"):
    return {
        "threads": threads,
        "threads_source": f"{cores} cores // {processes} process",
        "interop_threads": 2,
        "thread_env": {},
        "processes": processes,
        "local_processes": processes,
        "cores": cores,
        "cpu_model": cpu,
        "load_start": list(load),
        "load_end": list(load),
        "others_cpu_cores": others,
        "gpu": None,
    }


def test_differences_name_what_differs():
    assert fairness.differences(cond(), cond()) == []
    assert fairness.differences(None, None) == []  # neither recorded (older bert_mp): nothing to say
    assert fairness.differences(cond(), cond(threads=1)) == ["threads 1 vs 2"]
    assert fairness.differences(cond(), cond(cpu="Other CPU")) == ["CPU Other CPU vs Test CPU 9000"]
    busy = fairness.differences(cond(), cond(others=1.8))
    assert busy == ["other work loaded the machine during this run only"]
    assert "the reference only" in fairness.differences(cond(others=1.8), cond())[0]
    # without /proc/stat the load at the start decides
    no_stat = cond(others=None, load=(3.5, 1.0, 0.5))
    assert fairness.is_busy(no_stat) and not fairness.is_busy(cond(others=None))
    assert fairness.differences(cond(), None) == ["conditions not recorded for this run"]


def _set_conditions(root: Path, by_run: dict) -> None:
    for name, c in by_run.items():
        path = root / "runs" / name / "summary.json"
        s = json.loads(path.read_text())
        s["conditions"] = c
        atomic_write_json(path, s)


def test_report_withholds_speedups_of_runs_measured_under_other_conditions(tmp_path, capsys):
    """The false 10x: fp32 slowed by other work, bf16 measured on an idle machine."""
    root = _make_sweep(tmp_path / "sweep")
    busy = cond(others=1.7, load=(3.9, 3.0, 2.0))
    _set_conditions(root, {"fp32": busy, "fp32-seed43": busy, "bf16": cond(), "fp16": busy, "fp16-bad": busy})
    assert main(["report", str(root)]) == 0
    out = capsys.readouterr().out
    bf16_line = next(ln for ln in out.splitlines() if ln.strip().startswith("bf16 "))
    assert "speed not compared" in bf16_line and "x fp32 speed" not in bf16_line
    fp16_line = next(ln for ln in out.splitlines() if ln.strip().startswith("fp16 "))
    assert "1.90x fp32 speed" in fp16_line  # same conditions as fp32: quoted
    md = (root / "report.md").read_text()
    assert "Run conditions" in md and "Not comparable" in md
    assert "bf16 (other work loaded the machine during the reference only)" in md
    assert "sweep.rerun=[fp32,bf16]" in md
    summary = json.loads((root / "summary.json").read_text())
    ladder = {r["name"]: r for r in summary["groups"][0]["speed_ladder"]}
    assert ladder["bf16"]["speedup_vs_fp32"] is None and ladder["bf16"]["conditions_differ"]
    assert ladder["fp16"]["speedup_vs_fp32"] == 1.9

    # a thread count that differs is flagged too; equal conditions everywhere quote every speed-up
    _set_conditions(root, {"bf16": cond(threads=1, others=1.7, load=(3.9, 3.0, 2.0))})
    assert main(["report", str(root)]) == 0
    assert "threads 1 vs 2" in (root / "report.md").read_text()
    _set_conditions(root, {n: cond() for n in ("fp32", "fp32-seed43", "bf16", "fp16", "fp16-bad")})
    assert main(["report", str(root)]) == 0
    assert "2.50x fp32 speed" in capsys.readouterr().out
    assert "Not comparable" not in (root / "report.md").read_text()
