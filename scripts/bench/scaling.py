"""Multi-process scaling efficiency on CPU (gloo): DDP and FSDP2, 1 vs N processes, weak scaling.

Each process keeps the same micro-batch and one torch thread, so N processes do N times the work of
one; efficiency = tokens/s of N processes / (N x tokens/s of one process). Every configuration runs
through the real CLI (``bert-mp launch --num_processes N [--config_file configs/accelerate/fsdp.yaml]
train``), the rounds interleave the configurations (1, N, 1, N, ...) so that a change of the
machine's load hits all of them alike, and each run's tokens/s is ``summary.json``'s (after its
warm-up steps), with the load it met (``conditions``). The median round is reported.

On a machine with fewer free cores than processes the figure measures the machine, not bert_mp: the
JSON records the cores, the load average and the cores other processes used during each run.

    python scripts/bench/scaling.py --processes 1 2 --strategies ddp fsdp --out docs/benchmarks/scaling_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FSDP = ROOT / "configs" / "accelerate" / "fsdp.yaml"


def versions() -> dict[str, str]:
    import accelerate
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
    }


def run(workdir: Path, strategy: str, processes: int, args: argparse.Namespace, port: int) -> dict:
    """One launch; returns its throughput and conditions from summary.json."""
    out = workdir / f"{strategy}-p{processes}-{port}"
    launch = ["--num_processes", str(processes), "--main_process_port", str(port)]
    if strategy == "fsdp":
        launch = ["--config_file", str(FSDP), *launch]
    overrides = [
        "data.source=builtin",
        f"data.max_seq_length={args.seq}",
        f"data.cache_dir={workdir / 'data'}",
        f"model.preset={args.preset}",
        "model.hidden_dropout_prob=0",
        "model.attention_probs_dropout_prob=0",
        f"train.micro_batch_size={args.micro}",
        f"train.global_batch_size={args.micro * processes}",  # weak scaling: the same work per process
        f"train.max_steps={args.steps}",
        "train.export=false",
        "train.eval_max_batches=1",
        "train.progress_bar=false",
        f"train.output_dir={out}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "bert_mp", "launch", *launch, "train", *overrides]
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=workdir)
    if proc.returncode != 0:
        raise RuntimeError(f"{strategy} x {processes} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    cond = summary["conditions"]
    return {
        "tokens_per_sec": summary["throughput"]["tokens_per_sec"],
        "step_ms": summary["throughput"]["step_ms"],
        "strategy": summary["strategy"]["label"],
        "wall_s": round(time.perf_counter() - started, 1),
        "load_start": cond["load_start"],
        "load_end": cond["load_end"],
        "others_cpu_cores": cond["others_cpu_cores"],
        "cores": cond["cores"],
        "cpu_model": cond["cpu_model"],
    }


def efficiency(runs: list[dict], strategies: list[str], processes: list[int]) -> dict:
    """Per strategy and process count: the median tokens/s over the rounds, the efficiency of the
    medians, and each round's own efficiency (its N-process run against its 1-process run, measured
    minutes apart: the fairer pairing on a machine whose load changes)."""
    base = min(processes)
    out: dict = {}
    for strategy in strategies:
        mine = [r for r in runs if r["strategy_asked"] == strategy]
        med = {
            n: statistics.median(r["tokens_per_sec"] for r in mine if r["processes"] == n) for n in processes
        }
        rounds = sorted({r["round"] for r in mine})
        out[strategy] = {}
        for n in processes:
            per_round = []
            for k in rounds:
                one = next((r for r in mine if r["round"] == k and r["processes"] == base), None)
                many = next((r for r in mine if r["round"] == k and r["processes"] == n), None)
                if one and many:
                    per_round.append(many["tokens_per_sec"] / (one["tokens_per_sec"] * n / base))
            out[strategy][str(n)] = {
                "median_tokens_per_sec": med[n],
                "efficiency": med[n] / (med[base] * n / base),
                "efficiency_per_round": per_round,
            }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--strategies", nargs="+", default=["ddp", "fsdp"], choices=["ddp", "fsdp"])
    p.add_argument("--preset", default="mini")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=8, help="sequences per process per step")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=Path("runs/bench_scaling"))
    p.add_argument("--out", type=Path, default=Path("runs/bench_scaling.json"))
    args = p.parse_args(argv)
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "command": "python scripts/bench/scaling.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "versions": versions(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "setup": {
            "preset": args.preset,
            "seq": args.seq,
            "micro_batch_per_process": args.micro,
            "steps": args.steps,
        },
        "runs": [],
    }
    port = 29700 + os.getpid() % 200
    for round_ in range(args.rounds):
        for strategy in args.strategies:
            for n in args.processes:
                port += 1
                row = {
                    "round": round_,
                    "strategy_asked": strategy,
                    "processes": n,
                    **run(args.workdir, strategy, n, args, port),
                }
                report["runs"].append(row)
                print(json.dumps(row), flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(report, indent=1) + "\n")  # each row as soon as it is measured
    report["efficiency"] = efficiency(report["runs"], args.strategies, args.processes)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for strategy, rows in report["efficiency"].items():
        for n, r in rows.items():
            print(
                f"{strategy} x {n}: {r['median_tokens_per_sec']:.0f} tokens/s, efficiency {r['efficiency']:.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
