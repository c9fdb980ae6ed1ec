"""The ``levers`` and ``large`` phases: scripts/bench/levers.py's lever ladder on BERT-base, and BERT-large
seq 512 packed in bf16 and fp8 with fp8's parity verdict."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gpu import settings
from gpu.child import child_env, read_json, run_child, status

LEVERS_RUN = ["--levers", "compile,cuda_graphs,bf16_norms", "--attention", "--profile"]
LEVERS_RUN += ["--extra-levers", "no_dropout,packed,unpad"]
"""The lever ladder (cumulative), SDPA's kernels timed, the best row profiled, then each extra lever on
top of the best row (after the profile: a cut loses those first). Measured on an H200 (2026-11-28):
``compile,bf16_norms,cuda_graphs,unpad`` then ``no_dropout,max_autotune`` took more than 460 s
(max-autotune's GEMM autotuning was cut); bf16 norms now come after CUDA graphs, so the graphs are
compared with the plain compiled row and the norms with the graphed one."""


def phase_levers(args: argparse.Namespace) -> dict[str, Any]:
    """scripts/bench/levers.py: BERT-base seq 128 bf16 on the built-in corpus, eager padded then each
    lever on top; each row written when measured."""
    if args.dry_run:
        size = ["--preset", "tiny", "--seq", "32", "--micro-batch", "8", "--steps", "2", "--warmup", "1"]
        size += ["--heads", "2", "--attention-reps", "2", "--profile-steps", "2", "--profile-warmup", "1"]
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
        size += ["--large-seq", "64", "--large-micro-batch", "4", "--large-steps", "4", "--allow-emulated"]
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
