"""The ``ladder``, ``compile`` and ``paths`` phases: scripts/bench/train.py's precision ladder (eager and
compiled) and its encoder paths, each row in the JSON the moment it is measured."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gpu import settings
from gpu.child import child_env, read_json, run_child, status


def _bench(args: argparse.Namespace, compile_mode: str, name: str) -> dict[str, Any]:
    """bench_train.py for one ladder; its JSON gains each row the moment the row is measured."""
    if args.dry_run:
        size = ["--preset", "tiny", "--vocab", "300", "--seq", "32", "--micro-batch", "4"]
        size += ["--steps", "1", "--warmup", "1"]
    else:
        size = [
            "--preset",
            "base",
            "--vocab",
            "30522",
            "--seq",
            "128",
            "--micro-batch",
            str(args.micro_batch),
        ]
        size += ["--steps", "20", "--warmup", "5"]
    # the reference first: strict fp32 (bert_mp, then HF) and bf16 are the rows a cut must not lose
    precisions = "fp32,bf16,tf32,fp16,bf16_pure" if compile_mode == "none" else "bf16,tf32,fp16"
    if args.dry_run and compile_mode != "none":
        precisions = "tf32"  # the rehearsal checks the plumbing, one row is enough
    baselines = "fp32,bf16" if compile_mode == "none" else "fp32"
    bench_args = [*size, "--repeat", "1", "--precisions", precisions]
    bench_args += ["--baseline-precisions", baselines, "--compile", compile_mode]
    # a CPU rehearsal checks the plumbing; inductor on 2 cores would take minutes
    return _run_bench(args, name, bench_args, no_compile=args.dry_run and compile_mode != "none")


def _run_bench(
    args: argparse.Namespace, name: str, bench_args: list[str], no_compile: bool
) -> dict[str, Any]:
    """``scripts/bench/train.py BENCH_ARGS`` into ``bench_NAME.json``, published while it runs (a cut
    keeps every row finished before it); ``no_compile``: ``TORCH_COMPILE_DISABLE=1`` (CPU rehearsal)."""
    out = settings.STATE / f"bench_{name}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "scripts/bench/train.py", *bench_args, "--out", str(out)]
    env = child_env()
    if no_compile:
        env["TORCH_COMPILE_DISABLE"] = "1"
    rc, tail = run_child(
        cmd,
        args.budget,
        settings.STATE / f"bench_{name}.log",
        tick=lambda: args.progress({"bench": read_json(out)}),
        env=env,
    )
    return {"status": status(rc), "rc": rc, "bench": read_json(out), "tail": tail if rc else tail[-800:]}


def phase_ladder(args: argparse.Namespace) -> dict[str, Any]:
    res = _bench(args, "none", "ladder")
    res["device"] = (res.get("bench") or {}).get("device")
    return res


def phase_compile(args: argparse.Namespace) -> dict[str, Any]:
    return _bench(args, "model", "compile")


PATHS_RUN = "padded,unpad,unpad+compile"


def phase_paths(args: argparse.Namespace) -> dict[str, Any]:
    """bench_train.py --paths: the encoder paths of model.unpad side by side, each row written when measured."""
    if args.dry_run:
        size = ["--preset", "tiny", "--seq", "32", "--micro-batch", "4", "--steps", "1", "--warmup", "1"]
        size += ["--precisions", "fp32", "--corpus", "synthetic", "--vocab", "300"]
    else:
        size = ["--preset", "base", "--seq", "128", "--micro-batch", str(args.micro_batch)]
        size += ["--steps", "20", "--warmup", "5", "--precisions", "bf16", "--corpus", "builtin,short"]
    bench_args = ["--paths", PATHS_RUN, *size, "--repeat", "1", "--attention-dropout", "0"]
    return _run_bench(args, "paths", bench_args, no_compile=args.dry_run)
