"""The ``levers`` and ``large`` phases: scripts/bench/levers.py's lever ladder on BERT-base, and BERT-large
seq 512 packed in bf16 and fp8 with fp8's parity verdict."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gpu import settings
from gpu.child import child_env, read_json, run_child, status

LEVERS_RUN = ["--levers", "cuda_graphs", "--profile", "--attention", "--late-levers", "max_autotune"]
LEVERS_RUN += ["--extra-levers", "token_budget,varlen,no_attention_dropout,coordinate_descent"]
"""Eager, then today's best (whole-step compile + CUDA graphs: 30.8% MFU on an H200, docs/gpu.md), each new
lever on top of it alone - one static shape (``data.token_budget``), its rows with torch's varlen kernel
(no attention dropout: a recipe row), attention dropout 0 alone (a recipe row), inductor's
coordinate-descent tuning - then the profile of the fastest row that changes no recipe, SDPA's kernels
timed, and last max-autotune (the longest compile; with the carried cache). Each row is written when
measured; a cut loses the last first. Measured on an H200 (2026-11-28): ``compile,bf16_norms,cuda_graphs,unpad`` then
``no_dropout,max_autotune`` took more than 460 s; bf16 norms (0.93x there) and the bucketed unpadded rows
are left to ``scripts/bench/levers.py`` by hand."""


def phase_levers(args: argparse.Namespace) -> dict[str, Any]:
    """scripts/bench/levers.py: BERT-base seq 128 bf16 on the built-in corpus, eager padded then each
    lever on top; each row written when measured."""
    if args.dry_run:  # the sequence, not the speed: every row on any CPU, each a step or two
        size = ["--preset", "tiny", "--seq", "32", "--micro-batch", "4", "--steps", "1", "--warmup", "1"]
        size += ["--heads", "2", "--attention-reps", "1", "--profile-steps", "1", "--profile-warmup", "1"]
        size += ["--corpus", "synthetic", "--vocab", "512", "--cache-probe", "--allow-emulated"]  # any CPU
    else:
        size = ["--preset", "base", "--seq", "128", "--micro-batch", str(args.micro_batch)]
        size += ["--steps", "20", "--warmup", "5"]
    return _run_levers(args, "levers", [*size, *LEVERS_RUN])


def phase_large(args: argparse.Namespace) -> dict[str, Any]:
    """scripts/bench/levers.py --large: BERT-large seq 512 on packed rows, bf16 vs fp8 (torchao float8),
    then 200 steps each of bf16 (two seeds) and fp8, and fp8's parity verdict against bf16."""
    size = ["--no-ladder", "--large", "--steps", "20", "--warmup", "5"]
    if args.dry_run:
        size = ["--no-ladder", "--large", "--steps", "1", "--warmup", "1", "--large-preset", "tiny"]
        size += ["--large-seq", "32", "--large-micro-batch", "2", "--large-steps", "2", "--allow-emulated"]
        size += ["--corpus", "synthetic", "--vocab", "512", "--cache-probe"]
    return _run_levers(args, "large", size)


def _run_levers(args: argparse.Namespace, name: str, bench_args: list[str]) -> dict[str, Any]:
    out = settings.STATE / f"bench_{name}.json"
    out.unlink(missing_ok=True)
    env = child_env()
    if args.dry_run:
        env["TORCH_COMPILE_DISABLE"] = "1"  # the plumbing, not inductor on 2 cores
    rc, tail = run_child(
        [sys.executable, "scripts/bench/levers.py", *bench_args, "--out", str(out)],
        args.budget,
        settings.STATE / f"bench_{name}.log",
        tick=lambda: args.progress({name: read_json(out)}),
        env=env,
    )
    return {"status": status(rc), "rc": rc, name: read_json(out), "tail": tail if rc else tail[-800:]}
