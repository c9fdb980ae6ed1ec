"""Multi-process parity: ``accelerate launch --cpu --num_processes N`` (gloo) vs one process.

Trains the same tiny fp32 run (same global batch, dropout off) with 1, 2 and 4 processes through the
real CLI (``accelerate launch --config_file configs/accelerate/cpu_multiprocess.yaml --num_processes N
-m bert_mp train``) and reports, against the single-process run, the
largest per-step loss difference, the final eval loss difference and the largest final-weight
difference. One process accumulates ``global / micro`` micro-batches; N processes take a share each
and all-reduce, so only the floating-point summation order differs: the figures are round-off.

On a small CPU box 4 processes oversubscribe the cores; this is a correctness check, not a speed one.

    python scripts/bench/processes.py --processes 1 2 4 --out runs/multiprocess.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: its rooms import as packages
from drills.fault import DrillSpec, child_env, drill_config, prepare_builtin  # noqa: E402

from bench.harness import write_report  # noqa: E402
from bert_mp.core.config import save_config
from bert_mp.core.process.spawn import accelerate_launch
from bert_mp.core.storage.files import read_jsonl

ACCELERATE_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "accelerate" / "cpu_multiprocess.yaml"


def launch(cfg_path: Path, processes: int, log: Path) -> float:
    """Run ``bert-mp train`` under ``accelerate launch`` on the CPU; returns wall seconds."""
    # more than one process through the config file that users launch with (torchrun-style
    # spawning); one process with --cpu
    extra = ["--config_file", str(ACCELERATE_CONFIG)] if processes > 1 else []
    cmd = [
        *accelerate_launch(processes, cuda=False, extra=extra, port=29500 + os.getpid() % 1000),
        "-m",
        "bert_mp",
        "train",
        str(cfg_path),
    ]
    started = time.perf_counter()
    with open(log, "ab") as f:
        rc = subprocess.call(cmd, env=child_env(), stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        raise RuntimeError(f"{processes}-process run failed (exit {rc}); see {log}")
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("runs/multiprocess"))
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    spec = DrillSpec(max_steps=args.steps, save_every=0)
    data = work / "data"
    prepare_builtin(drill_config(work / "prepare", spec, data), work / "prepare.log")

    runs: dict[int, dict] = {}
    for n in sorted(set(args.processes) | {1}):
        out = work / f"p{n}"
        cfg = drill_config(out, spec, data)
        cfg.model.hidden_dropout_prob = cfg.model.attention_probs_dropout_prob = (
            0.0  # per-rank streams differ
        )
        cfg.train.global_batch_size = args.global_batch
        cfg.train.micro_batch_size = args.global_batch // max(args.processes)
        cfg.train.eval_every = 0
        cfg_path = work / f"p{n}.yaml"
        save_config(cfg, cfg_path)
        seconds = launch(cfg_path, n, work / f"p{n}.log")
        rows = list(read_jsonl(out / "metrics.jsonl"))
        summary = json.loads((out / "summary.json").read_text())
        assert summary["batch"]["processes"] == n, summary["batch"]
        runs[n] = {
            "seconds": seconds,
            "accumulation": summary["batch"]["accumulation"],
            "losses": [r["loss/total"] for r in rows if r["kind"] == "train"],
            "eval": [r["eval/loss_mlm"] for r in rows if r["kind"] == "eval"][-1],
            "weights": load_file(str(out / "final" / "model.safetensors")),
        }

    ref = runs[1]
    report = {"steps": args.steps, "global_batch": args.global_batch, "runs": []}
    print(
        f"{'procs':>5} {'accum':>5} {'max |dloss|':>12} {'max rel dloss':>13} {'|d eval|':>10} {'max |dw|':>10} {'wall s':>7}"
    )
    for n, r in sorted(runs.items()):
        assert len(r["losses"]) == len(ref["losses"]) == args.steps
        dl = [abs(a - b) for a, b in zip(r["losses"], ref["losses"])]
        rel = [d / abs(b) for d, b in zip(dl, ref["losses"])]
        dw = max(float((r["weights"][k] - ref["weights"][k]).abs().max()) for k in ref["weights"])
        row = {
            "processes": n,
            "accumulation": r["accumulation"],
            "max_abs_loss_diff": max(dl),
            "max_rel_loss_diff": max(rel),
            "eval_loss_diff": abs(r["eval"] - ref["eval"]),
            "max_abs_weight_diff": dw,
            "wall_seconds": round(r["seconds"], 1),
            "losses": r["losses"],
        }
        report["runs"].append(row)
        print(
            f"{n:>5} {r['accumulation']:>5} {max(dl):>12.3e} {max(rel):>13.3e} {row['eval_loss_diff']:>10.3e} "
            f"{dw:>10.3e} {r['seconds']:>7.1f}"
        )
    report["torch"] = torch.__version__
    if args.out:
        write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
