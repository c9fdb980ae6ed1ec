"""The scale-out benchmarks run end to end at toy sizes, and the scale model's arithmetic holds (no
timing is asserted: only that every measured field is there and the projection is consistent)."""

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


def test_bench_prepare_shards_runs(tmp_path):
    out = tmp_path / "shards.json"
    _run(
        [str(ROOT / "scripts" / "bench" / "prepare_shards.py"), "--size", "200KB", "--shares", "2"]
        + ["--workdir", str(tmp_path / "work"), "--out", str(out)],
        tmp_path,
    )
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert [r["shard"] for r in runs] == ["0/1", "0/2", "1/2"]
    assert runs[1]["documents"][0] == 0 and runs[1]["documents"][1] == runs[2]["documents"][0]
    assert all(r["peak_rss_bytes"] > 0 and r["tokens"] > 0 for r in runs)
    assert report["summary"]["shares_tokens_sum"] > 0


@pytest.mark.slow
def test_bench_prepare_scale_runs(tmp_path):
    """The whole benchmark through its children (their parts in this process, fast:
    unit/scripts/test_prepare_scale.py)."""
    out = tmp_path / "scale.json"
    script = str(ROOT / "scripts" / "bench" / "prepare_scale.py")
    sizes = ["--size", "200KB", "--reference-sizes", "100KB", "--vocab-size", "300"]
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
        ["given", "tokenize", "tokenize_same_malloc"],
        ["tokenize", "tokenize_same_malloc", "given"],
    ]
    s = report["summary"]
    assert 0 < s["vocabulary_share_of_wall"] < 1 and set(s["peak_anon_ratio_to_references"]) == {"100KB"}
    assert set(s["given_tokenizer_ratio_median"]) == {
        "whole",
        "tokenize_stage",
        "whole_cpu",
        "whole_same_malloc",
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


def test_the_scale_model_reads_every_input_from_its_file_and_divides_consistently():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from bench import scale_model
    finally:
        sys.path.pop(0)
    m = scale_model.measured()
    for key in ("gpu", "padding", "scaling", "prepare"):
        assert (ROOT / m[key]["file"]).is_file()
    assert m["gpu"]["row"] == "cuda_graphs" and m["gpu"]["setup"]["seq"] == 128
    rows = {(r["model"], r["gpus"]): r for r in scale_model.training_table(m, 0.5, (1, 8, 64), 2.0)}
    one, eight = rows[("BERT-base", 1)], rows[("BERT-base", 8)]
    assert eight["hours"] == pytest.approx(one["hours"] / (8 * 0.5))
    assert eight["gpu_hours"] == pytest.approx(one["gpu_hours"] / 0.5)
    assert rows[("BERT-large", 1)]["hours"] > 3 * one["hours"]  # ~3.4x the FLOPs per position
    assert one["usd"] == pytest.approx(one["gpu_hours"] * 2.0)
    prep = scale_model.prepare_table(m, (1, 8))
    assert prep[1]["hours"] < prep[0]["hours"] and prep[1]["read_hours"] == prep[0]["read_hours"]
    assert prep[1]["vocabulary_hours"] == prep[0]["vocabulary_hours"] > 0  # every share learns it
    cores = {(r["cores"], r["vocabulary_from"]): r for r in scale_model.cores_table(m, (2, 16))}
    sample, whole = cores[16, "the sample"], cores[16, "the whole corpus"]
    assert sample["hours"] < cores[2, "the sample"]["hours"]
    assert sample["vocabulary_hours"] == cores[2, "the sample"]["vocabulary_hours"]  # one thread
    assert whole["vocabulary_hours"] > 10 * sample["vocabulary_hours"]  # a corpus ~400 samples long
    parts = scale_model.prepare_parts(m)
    assert sum(parts.values()) / 3600 == pytest.approx(cores[2, "the sample"]["hours"])
    # the FLOPs per position match what bert_mp's MFU counted for the measured row, within the
    # corpus's shorter rows and its masked count
    counted = m["gpu"]["mfu"] * 989.4e12 / m["gpu"]["tokens_per_sec"]
    assert scale_model.BASE.flops_per_position(128) == pytest.approx(counted, rel=0.05)
