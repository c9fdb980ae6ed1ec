"""The ``sweep`` phase: a docstring corpus of real English written offline, then the short parity sweep,
each finished run published while the next trains."""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu import settings
from gpu.child import child_env, read_json, run_child
from gpu.summary import fmt


def _extract_docstrings(path: Path) -> str:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError, OSError, RecursionError, MemoryError):
        return ""
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc.split()) >= 8:
                parts.append(" ".join(doc.split()))
    return "\n".join(parts) + "\n\n" if parts else ""


def write_docstring_corpus(dest: Path, max_bytes: int, roots: list[Path] | None = None) -> dict[str, Any]:
    """Real English text offline: module/class/function docstrings of installed Python packages.

    One document per module (its docstrings, a blank line between documents), written to
    ``dest/corpus_NN.txt`` until ``max_bytes``. Deterministic (sorted paths, kept in order) and
    parsed on every core: the short sweep's 12 MB take seconds.
    """
    import multiprocessing as mp
    import site

    dest.mkdir(parents=True, exist_ok=True)
    roots = roots or [
        Path(p) for p in {*site.getsitepackages(), *sys.path} if p and Path(p).is_dir() and "packages" in p
    ]
    paths = [path for root in sorted(set(roots)) for path in sorted(root.rglob("*.py"))]
    written, docs, shard, fh = 0, 0, 0, None
    with mp.get_context("fork").Pool(max(1, min(16, os.cpu_count() or 1))) as pool:
        for text in pool.imap(_extract_docstrings, paths, chunksize=16):
            if not text:
                continue
            if fh is None or fh.tell() > 64 * 2**20:
                if fh:
                    fh.close()
                fh = open(dest / f"corpus_{shard:02d}.txt", "w", encoding="utf-8")  # noqa: SIM115 (rotating shards)
                shard += 1
            fh.write(text)
            written += len(text.encode())
            docs += 1
            if written >= max_bytes:
                pool.terminate()
                break
    if fh:
        fh.close()
    return {"bytes": written, "documents": docs, "files": shard}


def sweep_verdicts(report: dict[str, Any]) -> dict[str, str]:
    """``group/run -> "status: first reason"`` plus the sweep's own speed ladder, from its summary.json."""
    out: dict[str, str] = {}
    for g in report.get("groups") or []:
        for run, v in (g.get("verdicts") or {}).items():
            reasons = v.get("reasons") or []
            out[f"{g.get('name')}/{run}"] = v.get("status", "?") + (f": {reasons[0]}" if reasons else "")
        for row in g.get("speed_ladder") or []:
            if isinstance(row, dict) and row.get("name"):
                x, mfu = row.get("speedup_vs_fp32"), row.get("mfu")
                out[f"{g.get('name')}/{row['name']} speed"] = (
                    f"{fmt(row.get('tokens_per_sec'), digits=0)} tokens/s, x fp32 {fmt(x)}, MFU {fmt(mfu, pct=True)}"
                )
    return out


def sweep_runs(sweep_dir: Path, gemm_flops: float | None = None) -> dict[str, Any]:
    """Each finished run's figures from its own summary.json (written when the run ends), with the share of
    ``gemm_flops`` (the bf16 GEMM rate measured in this command) beside MFU."""
    runs: dict[str, Any] = {}
    for path in sorted(sweep_dir.glob("**/summary.json")):
        if path.parent == sweep_dir:
            continue
        d = read_json(path) or {}
        if "status" not in d or "steps" not in d:
            continue
        ev = d.get("final_eval") or {}
        tp = d.get("throughput") or {}
        runs[str(path.parent.relative_to(sweep_dir))] = {
            "status": d.get("status"),
            "steps": d.get("steps"),
            "eval_mlm_loss": ev.get("eval/loss_mlm"),
            "tokens_per_sec": tp.get("tokens_per_sec", tp.get("throughput/tokens_per_sec")),
            "positions_per_sec": tp.get("positions_per_sec"),
            "mfu": tp.get("mfu", tp.get("throughput/mfu")),
            "gemm_share": tp["flops_per_sec"] / gemm_flops
            if gemm_flops and tp.get("flops_per_sec")
            else None,
        }
    return runs


def measure_gemm_rate() -> dict[str, Any] | None:
    """``bench.harness.gemm_rate`` in a child (this process does not import torch), before the sweep
    takes the device."""
    code = "import json, sys; sys.path.insert(0, 'scripts'); from bench.harness import gemm_rate; print(json.dumps(gemm_rate()))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=settings.ROOT, env=child_env(), capture_output=True, text=True
    )
    return (
        json.loads(out.stdout.strip().splitlines()[-1])
        if out.returncode == 0 and out.stdout.strip()
        else None
    )


SWEEP_SIZES = {
    # config, output folder, corpus bytes
    "short": ("configs/sweep_gpu_short.yaml", "runs/sweep_gpu_short", 12 * 2**20),
    "long": ("configs/sweep_gpu_base.yaml", "runs/sweep_gpu_base", 400 * 2**20),
    "dry": ("configs/sweep_gpu_short.yaml", "runs/gpu_check/sweep_dry", 64 * 2**10),
}
DRY_SWEEP = [
    "model.preset=tiny",
    "train.max_steps=4",
    "train.global_batch_size=8",
    "train.micro_batch_size=8",
    "train.warmup_steps=1",
    "train.eval_every=0",
    "train.eval_max_batches=1",
    "data.vocab_size=500",
    "data.num_proc=1",
    "sweep.precisions=[fp32]",
    "sweep.recipe_precision=fp32",  # the recipe row's plumbing, at the reference's precision
    "sweep.profile_steps=0",
    "sweep.parity_window=2",
    "data.max_seq_length=32",
    "sweep.output_dir=runs/gpu_check/sweep_dry",
]


def phase_sweep(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    size = "dry" if args.dry_run else ("long" if args.long_sweep else "short")
    config, out_rel, corpus_bytes = SWEEP_SIZES[size]
    corpus = settings.ROOT / "runs" / "gpu_corpus"
    stats = corpus / "stats.json"
    if (read_json(stats) or {}).get("max_bytes") != corpus_bytes:  # none yet, or another size's
        shutil.rmtree(corpus, ignore_errors=True)
        info = write_docstring_corpus(corpus, corpus_bytes)
        stats.write_text(json.dumps({**info, "max_bytes": corpus_bytes}))
    corpus_info = {**json.loads(stats.read_text()), "seconds": round(time.monotonic() - t0, 1)}
    out_dir = settings.ROOT / out_rel
    cmd = [sys.executable, "-m", "bert_mp", "sweep", config, *(DRY_SWEEP if args.dry_run else [])]
    rate = measure_gemm_rate()
    flops = (rate or {}).get("flops_per_sec")

    def tick() -> None:
        args.progress({"config": config, "corpus": corpus_info, "runs": sweep_runs(out_dir, flops)})

    rc, tail = run_child(cmd, args.budget - (time.monotonic() - t0), settings.STATE / "sweep.log", tick=tick)
    if rc == 124 and (out_dir / "sweep.json").is_file():  # cut: the verdicts of the runs that finished
        run_child(
            [sys.executable, "-m", "bert_mp", "report", str(out_dir)], 60, settings.STATE / "report.log"
        )
    report = read_json(out_dir / "summary.json")
    return {
        "status": "ok"
        if rc == 0
        else ("incomplete: run the sweep again (it resumes)" if rc == 124 else "failed"),
        "rc": rc,
        "config": config,
        "corpus": corpus_info,
        "gemm_rate": rate,
        "runs": sweep_runs(out_dir, flops),
        "verdicts": sweep_verdicts(report) if report else None,
        "tail": tail[-2000:],
    }
