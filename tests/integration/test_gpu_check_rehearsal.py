"""`bash scripts/gpu_check.sh OUT --rehearse`: the command sequence docs/gpu.md gives for a lent GPU
machine, run on this CPU with tiny shapes, each command on a fresh copy of the repository (no
.gpu_site/, no runs/), so the script cannot rot between the rare GPU leases. About 2 minutes of CPU
on 2 cores (user + system time of the whole sequence)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from support import load_script

ROOT = Path(__file__).resolve().parents[2]
profiling = load_script("gpu/profiling")
settings = load_script("gpu/settings")


def test_docs_give_exactly_the_rehearsed_sequence():
    text = (ROOT / "docs" / "gpu.md").read_text()
    documented = re.findall(r'run\(command="bash scripts/gpu_check\.sh \$OUT ([a-z ]+)"', text)
    assert [tuple(c.split()) for c in documented] == list(settings.COMMANDS)


def test_rehearsal_runs_every_command_fresh_and_each_leaves_its_files(tmp_path):
    out = tmp_path / "rehearsal"
    env = {"PYTHON": sys.executable, "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    # the tests phase on one CPU test of two of its files (all four files are collected): its
    # plumbing is what is rehearsed; the suite runs every one of those tests itself
    env[settings.TESTS_K_ENV] = "test_recorder_basics or test_peak_table_matches_whole_names"
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(out), "--rehearse"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    record = json.loads((out / "rehearsal.json").read_text())
    assert record["ok"] and len(record["commands"]) == len(settings.COMMANDS)
    for i, (cmd, phases) in enumerate(zip(record["commands"], settings.COMMANDS), 1):
        # a fresh machine each time: every command installed first, then ran its phases
        assert list(cmd["statuses"]) == ["install", *phases] and set(cmd["statuses"].values()) == {"ok"}
        files = sorted(p.name for p in (out / f"command_{i}").iterdir())
        assert len(files) <= settings.MAX_OUT_FILES, files
        assert {"summary.json", "summary.md", "gpu_check.log", *(f"{p}.json" for p in phases)} <= set(files)
    by_phase = {}
    for i, phases in enumerate(settings.COMMANDS, 1):
        summary = json.loads((out / f"command_{i}" / "summary.json").read_text())
        by_phase.update({p: summary for p in phases})
    s = by_phase["levers"]
    levers = [r["lever"] for r in s["levers"]]
    assert s["dry_run"] and levers[:4] == ["eager", "compile", "cuda_graphs", "bf16_norms"], levers
    # the extra levers, each on top of the best row (which one is best depends on the machine)
    assert [x.rpartition("+")[2] for x in levers[4:]] == ["no_dropout", "packed", "unpad"], levers
    assert all(r["tokens_per_sec"] > 0 for r in s["levers"]), s["levers"]
    assert s["levers_profile"] and s["attention"]["dropout_0"]["fastest"]
    s = by_phase["large"]
    assert all(s["large"]["speed"][p]["tokens_per_sec"] > 0 for p in ("bf16", "fp8")), s["large"]
    assert s["large"]["fp8_parity"] in ("pass", "warn", "fail")
    s = by_phase["ladder"]
    assert [r["run"] for r in s["ladder"]][:2] == ["baseline_hf_fp32", "baseline_hf_bf16"]
    paths = {r["run"] for r in s["paths"] if r["tokens_per_sec"]}
    assert {"baseline_hf_fp32", "padded", "unpad", "unpad+compile"} <= paths, s["paths"]
    s = by_phase["tests"]
    assert s["tests"]["failed"] == 0 and s["tests"]["passed"] == 2
    assert s["kernel_check"]["fp32"]["verdict"]
    assert [r["path"] for r in s["profile"]] == profiling.PROFILE_PATHS.split(",")
    assert all(r["tokens_per_sec"] > 0 and r["shares"] for r in s["profile"])  # CPU: op self time
    assert by_phase["compile"]["ladder_compiled"]
    runs = by_phase["sweep"]["sweep_runs"]
    assert runs and all(r["status"] == "completed" and r["eval_mlm_loss"] > 0 for r in runs.values())
