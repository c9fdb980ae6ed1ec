"""Speed-ups are quoted only between runs measured under the same conditions (threads, load, devices)."""

import json
import math
from pathlib import Path

from bert_mp.cli import main
from bert_mp.core.config import Config, config_to_dict
from bert_mp.core.storage.files import atomic_write_json
from bert_mp.sweep import fairness
from bert_mp.sweep.record import GroupEntry, HostInfo, RunEntry, SweepRecord

STEPS = 40


def _rows(seed: int, tokens_per_sec: float) -> list[dict]:
    rows = []
    for step in range(1, STEPS + 1):
        mlm = (2.0 + 6.0 * math.exp(-step / 20)) * (1 + 0.01 * math.sin(step * seed))
        rows.append(
            {
                "step": step,
                "kind": "train",
                "loss/total": mlm + 0.6,
                "loss/mlm": mlm,
                "loss/nsp": 0.6,
                "throughput/tokens_per_sec": tokens_per_sec,
            }
        )
    rows.append({"step": STEPS, "kind": "eval", "eval/loss_mlm": 2.5, "eval/loss_nsp": 0.6})
    rows[-1].update({"eval/accuracy_mlm": 0.3, "eval/accuracy_nsp": 0.6})
    return rows


def _make_sweep(root: Path) -> Path:
    """A sweep folder as bert-mp sweep writes it: fp32 (+ its seed run) at 1000 tokens/s, bf16 at
    2500, fp16 at 1900."""
    runs = {"fp32": ("fp32", "reference", 1000.0), "fp32-seed43": ("fp32", "seed_spread", 1010.0)}
    runs.update({"bf16": ("bf16", "candidate", 2500.0), "fp16": ("fp16", "candidate", 1900.0)})
    entries = []
    for i, (name, (precision, role, tps)) in enumerate(runs.items()):
        d = root / "runs" / name
        d.mkdir(parents=True)
        rows = _rows(i + 1, tps)
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        summary = {
            "status": "completed",
            "steps": STEPS,
            "precision": {"name": precision, "device": "cpu", "device_name": "Test CPU 9000"},
            "versions": {"torch": "9.9"},
            "final_eval": rows[-1],
            "throughput": {"tokens_per_sec": tps, "step_ms": 4096e3 / tps, "mfu": None},
            "model": {"preset": "tiny"},
        }
        atomic_write_json(d / "summary.json", summary)
        entries.append(RunEntry(name, "default", precision, role, 42, [], f"runs/{name}", "completed"))
    cfg = Config()
    cfg.sweep.parity_window = 5
    cfg.sweep.profile_steps = 0
    SweepRecord(
        created="2000-01-01T00:00:00+00:00",
        sweep_file="configs/quickstart_sweep.yaml",
        base=None,
        launcher="python",
        host=HostInfo("test host", "python"),
        config=config_to_dict(cfg),
        groups=[GroupEntry("default", {})],
        runs=entries,
    ).write(root)
    return root


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
    flushed = {**cond(), "flush_denormal": "on"}
    assert fairness.differences({**cond(), "flush_denormal": "off"}, flushed) == [
        "subnormals flushed on vs off"
    ]
    assert fairness.differences(cond(), flushed) == []  # not recorded by the reference: nothing to compare
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
    _set_conditions(root, {"fp32": busy, "fp32-seed43": busy, "bf16": cond(), "fp16": busy})
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
    _set_conditions(root, {n: cond() for n in ("fp32", "fp32-seed43", "bf16", "fp16")})
    assert main(["report", str(root)]) == 0
    assert "2.50x fp32 speed" in capsys.readouterr().out
    assert "Not comparable" not in (root / "report.md").read_text()


def test_sweep_rerun_names_runs_of_the_sweep(monkeypatch):
    import pytest
    from support import ROOT

    from bert_mp.errors import ConfigError
    from bert_mp.sweep.runner import Sweep, load_sweep_config, rerun_asked

    monkeypatch.chdir(ROOT)
    cfg, base = load_sweep_config("configs/quickstart_sweep.yaml", ["sweep.rerun=[fp32,bf16]"])
    sweep = Sweep(cfg, base, Path("configs/quickstart_sweep.yaml"))
    sweep.check_rerun()
    runs = {r.name: r for g in sweep.groups for r in g.runs}
    assert rerun_asked(runs["fp32"], cfg.sweep.rerun) and not rerun_asked(runs["fp16"], cfg.sweep.rerun)
    cfg, base = load_sweep_config("configs/quickstart_sweep.yaml", ["sweep.rerun=[fp33]"])
    with pytest.raises(ConfigError, match=r"sweep.rerun: no run named fp33 .*fp32"):
        Sweep(cfg, base, None).check_rerun()
