"""The benchmark scripts run end to end at toy sizes and write the JSON the README's figures come
from (no timing is asserted: only that every measured field is there and sane)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import forkserver
from support import ROOT

from bert_mp.data import allocator


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
    # forked from the suite's server: the scripts keep to bert-mp's quiet defaults (tests/forkserver.py)
    r = forkserver.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def test_bench_prepare_runs(tmp_path):
    out = tmp_path / "prepare.json"
    _run(
        [
            str(ROOT / "scripts" / "bench" / "prepare.py"),
            "--size",
            "300KB",
            "--num-proc",
            "2",  # the forked tokenize-only pool and prepare's parallel path
            "--repeat",
            "1",  # the rotation over trials: tests/unit/scripts/test_prepare_scale.py
            "--shapes",
            "books-file",  # a shape with its own data.* override (each child imports torch: few)
            "--vocab-size",
            "500",
            "--workdir",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ],
        tmp_path,
    )
    (row,) = json.loads(out.read_text())["results"]
    assert row["shape"] == "books-file"
    assert row["overrides"] == ["data.documents=file"] and row["files"] >= 2
    assert 0 <= row["padding_fraction_at_max_seq_length"] < 1 and row["mean_example_length"] > 0
    assert [t["order"] for t in row["trials"]] == [
        ["tokenize", "prepare", "tokenize-same-malloc"]
    ]  # every kind
    for t in row["trials"]:
        assert t["prepare"]["tokens"] > 0 and t["tokenize_only"]["tokens"] > 0
        assert math.isfinite(t["ratio"]) and t["ratio"] > 0
        same = t["tokenize_only_same_malloc"]
        assert same["tokens"] == t["tokenize_only"]["tokens"]  # the same work, another allocator setting
        assert not t["tokenize_only"]["malloc_tuned"]
        assert same["malloc_tuned"] == allocator.available()
        assert math.isfinite(t["ratio_same_malloc"]) and t["ratio_same_malloc"] > 0
        tok = t["tokenize_only"]
        assert 0 < tok["seconds_pool_untimed"] <= tok["seconds"]  # the pool's start is on the clock
        assert t["ratio_pool_untimed"] <= t["ratio"]  # a faster baseline without it
        for side in ("prepare", "tokenize_only"):  # the same memory sampler runs on both sides
            mem = t[side]["memory_peaks_bytes"]
            assert mem["anon_largest_process"] > 0 and mem["anon_total"] >= mem["anon_largest_process"]
    lo, hi = row["ratio_min_max"]
    assert lo <= row["ratio"] <= hi


def test_bench_train_runs(tmp_path):
    out = tmp_path / "train.json"
    _run(
        [
            str(ROOT / "scripts" / "bench" / "train.py"),
            "--preset",
            "tiny",
            "--vocab",
            "300",
            "--seq",
            "32",
            "--micro-batch",
            "4",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--repeat",
            "2",
            "--precisions",
            "fp32,bf16",
            "--allow-emulated",  # bf16 on any CPU: this checks the script, not the speed
            "--out",
            str(out),
        ],
        tmp_path,
    )
    report = json.loads(out.read_text())
    assert len(report["rounds"]) == 2
    res = report["results"]
    assert res["baseline_hf_fp32"]["ratio_vs_baseline"] == 1.0
    for name in ("bert_mp_fp32", "bert_mp_bf16"):
        lo, hi = res[name]["ratio_min_max"]
        assert res[name]["tokens_per_sec"] > 0 and lo <= res[name]["ratio_vs_baseline"] <= hi
    assert res["bert_mp_bf16"]["precision_in_effect"]["autocast_dtype"] == "bfloat16"


def test_bench_train_paths_runs(tmp_path):
    """The padded / unpadded / packed comparison on a small many-short-documents corpus (the script,
    not the speed)."""
    out = tmp_path / "paths.json"
    _run(
        [
            str(ROOT / "scripts" / "bench" / "train.py"),
            *("--paths", "padded,unpad,unpad+pack", "--corpus", "short", "--corpus-bytes", "40000"),
            *("--preset", "tiny", "--seq", "64", "--micro-batch", "8", "--steps", "1", "--warmup", "1"),
            *("--repeat", "1", "--precisions", "fp32", "--interleaved-steps", "1", "--out", str(out)),
            *("--interleaved-precisions", "fp32,bf16"),
        ],
        tmp_path,
    )
    report = json.loads(out.read_text())
    short = report["corpora"]["short"]
    assert short["padding_fraction_at_max_seq_length"] > 0.05
    summary = short["summary"]
    assert set(summary) == {"baseline_hf_fp32", "padded", "unpad", "unpad+pack"}
    assert summary["padded"]["ratio_vs_padded_median"] == 1.0
    assert all(v["tokens_per_sec_median"] > 0 for v in summary.values())
    assert report["cpu_model"] is not None and "command" in report
    inter = short["interleaved_model_steps"]
    assert inter["padded"]["ratio_vs_padded_cpu"] == 1.0 and inter["batch_padding_fraction"] > 0
    assert all(inter[k]["tokens_per_cpu_sec"] > 0 for k in ("baseline", "padded", "unpad", "unpad+pack"))
    # bf16 (CPU autocast) rows: against the padded bf16 path, and each against its fp32 self
    assert inter["padded_bf16"]["ratio_vs_padded_cpu"] == 1.0
    assert all(
        inter[f"{k}_bf16"]["ratio_vs_fp32_cpu"] > 0 for k in ("baseline", "padded", "unpad", "unpad+pack")
    )


def test_profile_step_records_only_the_timed_steps(tmp_path):
    """scripts/bench/profile_step.py: the profiler window holds the ``--steps`` optimizer steps after the
    warm-up ones (not the warm-up, the evaluation or the final checkpoint)."""
    out = tmp_path / "profile.json"
    _run(
        [
            str(ROOT / "scripts" / "bench" / "profile_step.py"),
            *("--preset", "tiny", "--seq", "32", "--micro-batch", "4", "--steps", "2", "--warmup", "1"),
            *("--precision", "fp32", "--paths", "padded,unpad:bf16_pure", "--out", str(out)),
            "--allow-emulated",  # bf16_pure on a CPU without native bf16 too (the script, not the speed)
        ],
        tmp_path,
    )
    report = json.loads(out.read_text())
    assert set(report["paths"]) == {"padded", "unpad:bf16_pure"}
    assert [r["precision"] for r in report["paths"].values()] == ["fp32", "bf16_pure"]
    for row in report["paths"].values():
        assert row["profiled_optimizer_steps"] == 2 and row["profiled_events"] > 0
        assert row["bench"]["tokens_per_sec"] > 0


def test_bench_levers_runs_the_ladder_and_bert_large(tmp_path):
    """scripts/bench/levers.py at toy size, compile off (its sequence, not inductor on a CPU): each lever
    row in order with both ceilings (MFU: none on a CPU; the share of the GEMM rate it measured), the
    profile, SDPA's kernels timed, the cache probe; then BERT-large's bf16 / fp8 rows and fp8's parity."""
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1"}
    tiny = ["--steps", "1", "--warmup", "1", "--corpus", "synthetic", "--vocab", "512", "--allow-emulated"]
    out = tmp_path / "levers.json"
    _run(
        [
            str(ROOT / "scripts" / "bench" / "levers.py"),
            *(
                "--preset",
                "tiny",
                "--seq",
                "32",
                "--micro-batch",
                "4",
                "--heads",
                "2",
                "--attention-reps",
                "1",
            ),
            *("--profile-steps", "1", "--profile-warmup", "1", "--cache-probe", *tiny),
            *("--levers", "cuda_graphs", "--profile", "--attention", "--late-levers", "max_autotune"),
            *("--extra-levers", "token_budget,varlen,no_attention_dropout", "--out", str(out)),
        ],
        tmp_path,
        env,
    )
    report = json.loads(out.read_text())
    rows = report["ladder"] + report["extra"]
    got = [r["lever"] for r in rows[:2]] + [
        r["lever"].rpartition("+")[2] for r in rows[2:]
    ]  # on the best row
    assert got == ["eager", "cuda_graphs", "token_budget", "varlen", "no_attention_dropout", "max_autotune"]
    assert all(r["positions_per_sec"] >= r["tokens_per_sec"] > 0 and r["mfu"] is None for r in rows)
    assert all(r["gemm_share"] > 0 for r in rows) and report["gemm_rate"]["flops_per_sec"] > 0
    assert [r["recipe_change"] for r in report["extra"][:3]] == [False, True, True]
    assert report["extra"][0]["token_budget"]["attention"] == "block_diagonal"  # no varlen on a CPU
    assert report["profile"]["profiled_steps"] and report["attention"]["dropout_0"]
    assert report["cache_probe"]["fxgraph_cache_miss"] + report["cache_probe"]["fxgraph_cache_hit"] == 1
    large = tmp_path / "large.json"
    _run(
        [
            str(ROOT / "scripts" / "bench" / "levers.py"),
            *("--no-ladder", "--large", "--large-preset", "tiny", "--large-seq", "32"),
            *("--large-micro-batch", "2", "--large-steps", "2", *tiny, "--out", str(large)),
        ],
        tmp_path,
        env,
    )
    big = json.loads(large.read_text())["large"]
    assert all(big["speed"][p]["tokens_per_sec"] > 0 for p in ("bf16", "fp8")), big
    assert set(big["parity"]["runs"]) == {"bf16", "bf16_seed2", "fp8"}, big["parity"]
    assert big["parity"]["verdict"]["status"] in ("pass", "warn", "fail")
