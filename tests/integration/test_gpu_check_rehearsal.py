"""`bash scripts/gpu_check.sh OUT --rehearse`: the command sequence docs/gpu.md gives for a lent GPU
machine, run on this CPU with tiny shapes, each command on a fresh copy of the repository (no
.gpu_site/, no runs/, only what the previous command left to carry), so the script cannot rot between
the rare GPU leases. A dry run is about the sequence, not the speed: every row is a step or two of a
tiny model on synthetic rows, well inside its phase's dry budget; where a slow machine still meets a
budget, the phase's finished rows must be the start of the sequence and the cut must be recorded."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import load_script

ROOT = Path(__file__).resolve().parents[2]
profiling = load_script("gpu/profiling")
settings = load_script("gpu/settings")
gpu_levers = load_script("gpu/levers")

EXTRA = [
    *gpu_levers.LEVERS_RUN[gpu_levers.LEVERS_RUN.index("--extra-levers") + 1].split(","),
    *gpu_levers.LEVERS_RUN[gpu_levers.LEVERS_RUN.index("--late-levers") + 1].split(","),
]


def test_docs_give_exactly_the_rehearsed_sequence():
    text = (ROOT / "docs" / "gpu.md").read_text()
    documented = re.findall(r'run\(command="bash scripts/gpu_check\.sh \$OUT ([a-z ]+)"', text)
    assert [tuple(c.split()) for c in documented] == list(settings.COMMANDS)
    assert settings.COMMANDS[:3] == (("sweep",), ("levers",), ("large",))  # the next lease's order


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory) -> tuple[Path, dict, dict]:
    """The whole rehearsal, once: its record, and each phase's command summary by phase."""
    out = tmp_path_factory.mktemp("rehearsal")
    env = {"PYTHON": sys.executable, "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    # what tests/conftest.py sets for every process the suite starts (idle OpenMP threads sleep, no
    # Hub, the CPU mask of a masked run), and nothing else of this shell
    keep = ("OMP_WAIT_POLICY", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    keep += ("TRANSFORMERS_OFFLINE", "BERT_MP_LOAD_WARNING", "BERT_MP_CPU_MASK")
    env.update({k: os.environ[k] for k in keep if k in os.environ})
    # the tests phase on one CPU test (all four files are collected): its plumbing is what is
    # rehearsed; the suite runs every one of those tests itself
    env[settings.TESTS_K_ENV] = "test_peak_table_matches_whole_names"
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(out), "--rehearse"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )
    record = json.loads((out / "rehearsal.json").read_text())
    by_phase = {}
    for i, phases in enumerate(settings.COMMANDS, 1):
        summary = json.loads((out / f"command_{i}" / "summary.json").read_text())
        by_phase.update({p: summary for p in phases})
    return out, {"proc": proc, **record}, by_phase


def _finished(record: dict, phase: str) -> bool:
    """True when ``phase`` ran whole; False when a slow machine cut it at its dry budget after it had
    measured rows (its command said so; the caller asserts those rows); a phase cut with nothing
    measured hung, and fails, as does any other status."""
    cmd = next(c for c in record["commands"] if phase in c["statuses"])
    status = cmd["statuses"][phase]
    assert status in ("ok", "timeout"), (phase, status, record["proc"].stdout[-3000:])
    assert phase not in cmd["hung"] and cmd["rows"][phase] > 0, (
        f"{phase}: nothing measured within its {cmd['phase_seconds'][phase]} s (a hang)",
        record["proc"].stdout[-3000:],
    )
    return status == "ok"


def test_every_command_runs_fresh_and_leaves_its_files(rehearsal):
    out, record, _ = rehearsal
    assert len(record["commands"]) == len(settings.COMMANDS)
    for i, (cmd, phases) in enumerate(zip(record["commands"], settings.COMMANDS), 1):
        # a fresh machine each time: every command installed first, then ran its phases
        assert list(cmd["statuses"]) == ["install", *phases] and cmd["statuses"]["install"] == "ok"
        files = sorted(p.name for p in (out / f"command_{i}").iterdir())
        assert len(files) <= settings.MAX_OUT_FILES, files
        assert cmd["hung"] == [], cmd  # a phase cut at its budget with nothing measured
        assert {"summary.json", "summary.md", "gpu_check.log", *(f"{p}.json" for p in phases)} <= set(files)
        for p in phases:
            if not _finished(record, p):  # the cut is on the record, in the command's own log
                assert f"{p}: timeout" in (out / f"command_{i}" / "gpu_check.log").read_text()
    if all(_finished(record, p) for c in settings.COMMANDS for p in c):
        assert record["ok"] and record["proc"].returncode == 0, record["proc"].stdout[-3000:]


def test_the_levers_rows_in_order_with_both_ceilings_and_the_cache_carried_on(rehearsal):
    out, record, by_phase = rehearsal
    s = by_phase["levers"]
    rows = [r["lever"] for r in s["levers"]]
    want = ["eager", "cuda_graphs", *(f"+{x}" for x in EXTRA)]
    got = rows[:2] + [f"+{r.rpartition('+')[2]}" for r in rows[2:]]  # on the ladder's best row
    assert s["dry_run"] and got == (want if _finished(record, "levers") else want[: len(got)]), rows
    for r in s["levers"]:
        assert r["positions_per_sec"] >= r["tokens_per_sec"] > 0 and r["mfu"] is None  # CPU: no peak
        assert r["gemm_share"] > 0, r  # of the bf16 GEMM rate this CPU measured in the same command
    budget = [r for r in s["levers"] if r["lever"].endswith(("token_budget", "varlen"))]
    assert all(r["token_budget"]["attention"] == "block_diagonal" for r in budget)  # no varlen on a CPU
    assert [r["recipe_change"] for r in s["levers"]][2:5] == [False, True, True][: len(rows) - 2]
    assert s["gemm_rate"]["levers"]["flops_per_sec"] > 0
    md = (out / "command_2" / "summary.md").read_text()
    assert "| positions/s |" in md and "| of GEMM rate |" in md and "Measured bf16 GEMM rate" in md
    if _finished(record, "levers"):
        assert s["levers_profile"] and s["attention"]["dropout_0"]["fastest"]
    # inductor's cache: levers compiled a probe into it and packed it; large got it carried in and hit
    assert s["inductor_cache"]["packed"]["packed"] is True
    large = json.loads((out / "command_3" / "large.json").read_text())["large"]
    assert by_phase["large"]["inductor_cache"]["carried_in"]["carried"] is True
    assert large["cache_probe"]["fxgraph_cache_hit"] == 1 and large["cache_probe"]["fxgraph_cache_miss"] == 0


def test_the_other_commands_measure_what_they_should(rehearsal):
    _, record, by_phase = rehearsal
    runs = by_phase["sweep"]["sweep_runs"]
    finished = _finished(record, "sweep")
    done = {name: r for name, r in runs.items() if r["status"] == "completed"}
    assert len(runs) - len(done) <= (0 if finished else 1), runs  # a cut stops (saves) the run it meets
    # both ceilings for the sweep's rows too: MFU (n/a on a CPU) and the command's own GEMM rate
    assert all(r["gemm_share"] > 0 and r["positions_per_sec"] >= r["tokens_per_sec"] for r in done.values())
    if finished:  # the reference, its second seed and the recipe row, with verdicts
        assert set(runs) == {"runs/fp32", "runs/fp32-seed43", "runs/fp32+no_attention_dropout"}
        assert by_phase["sweep"]["sweep"]["default/fp32+no_attention_dropout"].split(":")[0] in (
            "pass",
            "warn",
            "fail",
        )
    if _finished(record, "large"):
        s = by_phase["large"]
        assert all(s["large"]["speed"][p]["tokens_per_sec"] > 0 for p in ("bf16", "fp8")), s["large"]
        assert s["large"]["fp8_parity"] in ("pass", "warn", "fail")
    s = by_phase["ladder"]
    assert [r["run"] for r in s["ladder"]][:2] == ["baseline_hf_fp32", "baseline_hf_bf16"]
    assert all(r["gemm_share"] for r in s["ladder"] if r["run"].startswith("bert_mp") and not r["skipped"])
    paths = {r["run"] for r in s["paths"] if r["tokens_per_sec"]}
    if _finished(record, "paths"):
        assert {"baseline_hf_fp32", "padded", "unpad", "unpad+compile"} <= paths, s["paths"]
    s = by_phase["tests"]
    assert s["tests"]["failed"] == 0 and s["tests"]["passed"] == 1
    if _finished(record, "kernels"):
        assert s["kernel_check"]["fp32"]["verdict"]
    done = [r["path"] for r in s["profile"]]
    assert done == profiling.PROFILE_PATHS.split(",")[: len(done)] and done
    assert all(r["tokens_per_sec"] > 0 and r["shares"] for r in s["profile"])  # CPU: op self time
    assert by_phase["compile"]["ladder_compiled"]
