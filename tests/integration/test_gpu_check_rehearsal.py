"""`bash scripts/gpu_check.sh OUT --rehearse`: the GPU check's dry run (tiny shapes) on this CPU, in a
fresh copy of the repository (no runs/, no .venv), so the check cannot rot between the runs on a GPU.
A dry run is about the plumbing, not the speed: every phase is a step or two of a tiny model, well
inside its share of the budget. A phase cut with nothing written hung, and fails the rehearsal; where a
slow machine still cuts a phase after it wrote rows, those rows are asserted and the cut is recorded."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT, load_script

check = load_script("gpu/check")


def test_docs_give_the_checks_real_options():
    """Every option docs/gpu.md gives to scripts/gpu_check.sh is one it takes (--wheels: the shell's)."""
    text = (ROOT / "docs" / "gpu.md").read_text()
    lines = re.findall(r"bash scripts/gpu_check\.sh ([^`\n]+)", text)
    used = {a.split("=")[0] for line in lines for a in line.split() if a.startswith("--")}
    source = (ROOT / "scripts" / "gpu" / "check.py").read_text() + (
        ROOT / "scripts" / "gpu_check.sh"
    ).read_text()
    assert {"--phases", "--budget", "--rehearse"} <= used, used
    assert all(f'"{o}"' in source or f"{o})" in source for o in used), used


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory) -> tuple[dict, subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("rehearsal")
    env = {"PYTHON": sys.executable, "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    # what tests/conftest.py sets for every process the suite starts, and nothing else of this shell
    keep = ("OMP_WAIT_POLICY", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    keep += ("TRANSFORMERS_OFFLINE", "BERT_MP_LOAD_WARNING", "BERT_MP_CPU_MASK")
    env.update({k: os.environ[k] for k in keep if k in os.environ})
    # the tests phase on one CPU test of the four files (all collected): the suite runs every one itself
    argv = ["bash", "scripts/gpu_check.sh", str(out), "--rehearse", "--budget", "600"]
    argv += ["--tests-k", "test_peak_table_matches_whole_names"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1200, env=env)
    return json.loads((out / "rehearsal.json").read_text()), proc, out / "check"


def _finished(verdict: dict, phase: str, proc) -> bool:
    """True when ``phase`` ran whole; False when a slow machine cut it after it measured rows (the
    caller asserts those rows); a phase cut with nothing measured hung, and fails, as does any other status."""
    assert verdict["statuses"][phase] in ("ok", "timeout"), (phase, proc.stdout[-3000:])
    assert phase not in verdict["hung"] and verdict["rows"][phase] > 0, (phase, proc.stdout[-3000:])
    return verdict["statuses"][phase] == "ok"


def test_the_dry_run_leaves_every_file_and_measures_each_phase(rehearsal):
    verdict, proc, out = rehearsal
    assert verdict["missing"] == [] and verdict["hung"] == [], (verdict, proc.stdout[-3000:])
    finished = {p: _finished(verdict, p, proc) for p in check.PHASES}
    if all(finished.values()):
        assert verdict["ok"] and proc.returncode == 0, proc.stdout[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (
        summary["machine"]["torch"] and summary["dry_run"] and list(summary["phases"]) == list(check.PHASES)
    )
    tests = json.loads((out / "tests.json").read_text())["measured"]
    assert tests == {"passed": 1, "skipped": 0, "failed": []}
    bench = json.loads((out / "bench.json").read_text())["measured"]
    assert list(bench)[0] == "baseline_hf_fp32" and all(r["tokens_per_sec"] > 0 for r in bench.values())
    if finished["bench"]:
        assert set(bench) == {"baseline_hf_fp32", "bert_mp_fp32"}
    sweep = json.loads((out / "sweep.json").read_text())["measured"]
    done = {n: r for n, r in sweep["runs"].items() if r["status"] == "completed"}
    assert len(sweep["runs"]) - len(done) <= (0 if finished["sweep"] else 1)  # a cut saves the run it meets
    assert all(r["tokens_per_sec"] > 0 and r["eval_mlm_loss"] > 0 for r in done.values())
    if finished["sweep"]:  # the reference, its second seed and the recipe row, with verdicts
        assert set(sweep["runs"]) == {"fp32", "fp32-seed43", "fp32+no_attention_dropout"}
        assert sweep["verdicts"]["default/fp32+no_attention_dropout"] in ("pass", "warn", "fail")
    assert "===== sweep =====" in (out / "check.log").read_text()
