"""The scale-out benchmarks run end to end at toy sizes (no timing is asserted: only that every
measured field is there)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
from support import ROOT


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # forked from the suite's server (tests/forkserver.py); the shares' prepares start fresh
    r = forkserver.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.slow
def test_bench_prepare_scale_runs(tmp_path):
    """The whole benchmark through its children (their parts in this process, fast:
    unit/scripts/test_prepare_scale.py)."""
    out = tmp_path / "scale.json"
    script = str(ROOT / "scripts" / "bench" / "prepare.py")
    sizes = ["--mode", "scale", "--size", "200KB", "--reference-sizes", "100KB", "--vocab-size", "300"]
    _run(
        [
            script,
            *sizes,
            "--repeat",
            "2",
            "--same-malloc",
            "--workdir",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ],
        tmp_path,
    )
    report = json.loads(out.read_text())
    assert set(report["learned"]) == {"100KB", "200KB"}
    assert all(c["duplicate_documents"] == 0 for c in report["corpora"].values())
    assert [t["order"] for t in report["trials"]] == [
        ["given", "tokenize", "tokenize_plain_ascii", "tokenize_same_malloc"],
        ["tokenize", "tokenize_plain_ascii", "tokenize_same_malloc", "given"],
    ]
    assert report["mode"] == "scale" and report["command"].startswith("python ")
    s = report["summary"]
    assert 0 < s["vocabulary_share_of_wall"] < 1 and set(s["peak_anon_ratio_to_references"]) == {"100KB"}
    assert set(s["given_tokenizer_ratio_median"]) == {
        "whole",
        "tokenize_stage",
        "whole_cpu",
        "whole_same_malloc",
        "whole_vs_same_encoders",
        "tokenize_stage_vs_same_encoders",
        "whole_cpu_vs_same_encoders",
    }
    assert all(t["ratios"]["same_tokens"] for t in report["trials"])


@pytest.mark.slow
def test_bench_scaling_runs(tmp_path):
    out = tmp_path / "scaling.json"
    _run(
        [
            str(ROOT / "scripts" / "bench" / "scaling.py"),
            "--processes",
            "1",
            "2",
            "--strategies",
            "ddp",
            "fsdp",
        ]
        + ["--preset", "tiny", "--seq", "32", "--micro", "2", "--steps", "3", "--rounds", "1"]
        + ["--workdir", str(tmp_path / "work"), "--out", str(out)],
        tmp_path,
    )
    report = json.loads(out.read_text())
    assert {r["strategy"] for r in report["runs"]} >= {"single process", "DDP (nothing sharded; gloo)"}
    assert (
        set(report["efficiency"]) == {"ddp", "fsdp"} and report["efficiency"]["ddp"]["1"]["efficiency"] == 1.0
    )
