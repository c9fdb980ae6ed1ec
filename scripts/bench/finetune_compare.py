"""Does bert_mp pretraining help downstream? Fine-tune one architecture from a pretrained checkpoint
and from random initialisation, with the same task, budget and seeds, and report both.

    python scripts/bench/finetune_compare.py                      # pretrain (prepare + train), then compare
    python scripts/bench/finetune_compare.py --checkpoint runs/finetune_compare/pretrain   # reuse a run

Pretraining runs ``bert-mp prepare`` and ``bert-mp train`` with ``--pretrain-config`` (the built-in
corpus) in subprocesses and times them; fine-tuning runs ``--finetune-config`` (the built-in
stdlib-package task) in this process once per (init, seed). Writes ``compare.json`` and
``compare.md`` (the table) into ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bert_mp.core.config import FinetuneConfig, load_config
from bert_mp.core.numerics.precision import device_name, library_versions
from bert_mp.core.storage.files import atomic_write_json, atomic_write_text
from bert_mp.finetune.metrics import classification_metrics
from bert_mp.finetune.model import load_tokenizer, resolve_checkpoint
from bert_mp.finetune.tasks import build_label_space, encode_labels, load_task
from bert_mp.finetune.trainer import run_finetune

ROOT = Path(__file__).resolve().parents[2]
INITS = ("pretrained", "random")


def _run(cmd: list[str]) -> float:
    """Run a bert-mp command, streaming its output; returns wall seconds."""
    print("+", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    return time.perf_counter() - t0


def pretrain(config: str, out: Path, overrides: list[str]) -> dict:
    """``bert-mp prepare`` + ``bert-mp train`` into ``out``; what ran and how long it took."""
    bert_mp = [sys.executable, "-m", "bert_mp"]
    # a re-run of this script replaces its own earlier runs
    ov = [f"train.output_dir={out}", "train.overwrite_output_dir=true", *overrides]
    prepare_s = _run([*bert_mp, "prepare", config, *ov])
    train_s = _run([*bert_mp, "train", config, *ov])
    return {
        "command": f"bert-mp prepare {config} {' '.join(ov)} && bert-mp train {config} {' '.join(ov)}",
        "prepare_wall_s": prepare_s,
        "train_wall_s": train_s,
    }


def pretrain_facts(run_dir: Path) -> dict:
    """Steps, time and final MLM/NSP eval from a train run's summary.json."""
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        return {}
    s = json.loads(summary_path.read_text(encoding="utf-8"))
    return {
        "status": s.get("status"),
        "steps": s.get("steps"),
        "elapsed_s": s.get("elapsed_s"),
        "final_eval": s.get("final_eval"),
        "model": s.get("model"),
        "precision": (s.get("precision") or {}).get("name"),
    }


def _mean(values: list[float]) -> float:
    return statistics.fmean(values)


def _spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def markdown(result: dict) -> str:
    rows = [
        "| init | seed | val accuracy | val macro-F1 | test accuracy | test macro-F1 | test MCC | fine-tune s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["runs"]:
        v, t = r["validation"], r["test"]
        rows.append(
            f"| {r['init']} | {r['seed']} | {v['accuracy']:.3f} | {v['macro_f1']:.3f} | {t['accuracy']:.3f} | "
            f"{t['macro_f1']:.3f} | {t['mcc']:.3f} | {r['train_elapsed_s']:.0f} |"
        )
    if len({r["seed"] for r in result["runs"]}) > 1:
        for init in INITS:
            m = result["mean"][init]
            rows.append(
                f"| **{init} (mean)** | | | {m['val_macro_f1']:.3f} | {m['test_accuracy']:.3f} | "
                f"{m['test_macro_f1']:.3f} ± {m['test_macro_f1_sd']:.3f} | {m['test_mcc']:.3f} | |"
            )
    b = result["bag_of_wordpieces"]
    rows.append(
        f"| bag-of-wordpieces + logistic regression | | {b['validation']['accuracy']:.3f} | "
        f"{b['validation']['macro_f1']:.3f} | {b['test']['accuracy']:.3f} | {b['test']['macro_f1']:.3f} | "
        f"{b['test']['mcc']:.3f} | |"
    )
    p = result["pretraining"]
    ev = p.get("final_eval") or {}
    lines = [
        f"Task: `{result['task']}` ({result['num_labels']} classes; train/validation/test = "
        f"{result['sizes']['train']}/{result['sizes']['validation']}/{result['sizes']['test']} docstrings, "
        "split by module).",
        "",
        *rows,
        "",
        f"Pretraining: {p.get('steps')} steps of `{(p.get('model') or {}).get('preset', '?')}` in "
        f"{(p.get('elapsed_s') or 0) / 60:.1f} min (train loop); final MLM accuracy "
        f"{ev.get('eval/accuracy_mlm', float('nan')):.3f}, perplexity {ev.get('eval/perplexity', float('nan')):.0f}, "
        f"NSP accuracy {ev.get('eval/accuracy_nsp', float('nan')):.3f}.",
        f"Majority class test accuracy: {b['majority_class_test_accuracy']:.3f}.",
        f"Margin (test macro-F1, pretrained - random): {result['margin_test_macro_f1']:+.3f}; "
        f"verdict: **{result['verdict']}**.",
        f"Machine: {result['machine']['device']} ({result['machine']['cpus']} CPUs, shared with other jobs), "
        f"{result['date']}.",
    ]
    return "\n".join(lines) + "\n"


def bow_baseline(ft: FinetuneConfig, tokenizer_ref: str, seed: int) -> dict:
    """Surface-feature reference: logistic regression on bag-of-wordpieces of the same truncated input.

    Tells whether the task is solvable from which words occur, without any word order or context.
    """
    task = load_task(ft)
    tokenizer = load_tokenizer(tokenizer_ref)
    space = build_label_space(task.splits["train"]["label"], task.stats.get("label_names"))

    def features(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        ds = task.splits[split]
        enc = tokenizer(
            list(ds["text"]), truncation=True, max_length=ft.max_seq_length, add_special_tokens=True
        )
        x = torch.zeros(len(ds), len(tokenizer))
        for i, ids in enumerate(enc["input_ids"]):
            x[i].index_add_(0, torch.tensor(ids), torch.ones(len(ids)))
        ids, _ = encode_labels(list(ds["label"]), space, split)
        return torch.log1p(x), torch.tensor(ids)

    (xtr, ytr), (xva, yva), (xte, yte) = features("train"), features("validation"), features("test")
    torch.manual_seed(seed)
    best: dict = {"val": None}
    for weight_decay in (1e-4, 1e-3, 1e-2):
        layer = torch.nn.Linear(xtr.shape[1], space.size)
        opt = torch.optim.AdamW(layer.parameters(), lr=0.05, weight_decay=weight_decay)
        for _ in range(200):  # full-batch: a convex problem, 200 Adam steps converge
            opt.zero_grad()
            torch.nn.functional.cross_entropy(layer(xtr), ytr).backward()
            opt.step()
        with torch.no_grad():
            val = classification_metrics(yva.tolist(), layer(xva).argmax(-1).tolist())
            if best["val"] is None or val["macro_f1"] > best["val"]["macro_f1"]:
                test = classification_metrics(yte.tolist(), layer(xte).argmax(-1).tolist())
                best = {"val": val, "test": test, "weight_decay": weight_decay}
    majority = max(set(ytr.tolist()), key=ytr.tolist().count)
    return {
        "validation": {k: best["val"][k] for k in ("accuracy", "macro_f1", "mcc")},
        "test": {k: best["test"][k] for k in ("accuracy", "macro_f1", "mcc")},
        "weight_decay": best["weight_decay"],
        "majority_class_test_accuracy": float((yte == majority).float().mean()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pretrain-config", default="configs/finetune_compare_pretrain.yaml")
    ap.add_argument("--finetune-config", default="configs/finetune_builtin.yaml")
    ap.add_argument("--checkpoint", help="an existing train run folder (skips pretraining)")
    ap.add_argument("--out", default="runs/finetune_compare")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--pretrain-override", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--finetune-override", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.checkpoint:
        run_dir, how = Path(args.checkpoint), {"command": f"existing run {args.checkpoint}"}
    else:
        run_dir = out / "pretrain"
        how = pretrain(args.pretrain_config, run_dir, args.pretrain_override)
    pretraining = {**how, **pretrain_facts(run_dir)}
    if pretraining.get("model") is None:
        pretraining["model"] = {}
    pretraining["model"].setdefault("preset", load_config(args.pretrain_config).model.preset)

    runs = []
    for seed in args.seeds:
        for init in INITS:
            overrides = [
                f"finetune.checkpoint={run_dir}",
                f"finetune.init={init}",
                f"finetune.seed={seed}",
                f"finetune.output_dir={out / f'{init}_seed{seed}'}",
                "finetune.overwrite_output_dir=true",
                "finetune.progress_bar=false",
                *args.finetune_override,
            ]
            cfg = load_config(args.finetune_config, overrides)
            print(f"+ fine-tune init={init} seed={seed}", flush=True)
            s = run_finetune(cfg)
            runs.append(
                {
                    "init": init,
                    "seed": seed,
                    "steps": s["steps"],
                    "train_elapsed_s": s["train_elapsed_s"],
                    "selected_step": s["selected"]["step"],
                    "validation": {k: s["validation"][k] for k in ("accuracy", "macro_f1", "mcc", "loss")},
                    "test": {k: s["test"][k] for k in ("accuracy", "macro_f1", "mcc", "loss")},
                    "test_per_class_f1": s["test"]["per_class_f1"],
                }
            )
    mean = {}
    for init in INITS:
        mine = [r for r in runs if r["init"] == init]
        mean[init] = {
            "val_macro_f1": _mean([r["validation"]["macro_f1"] for r in mine]),
            "test_accuracy": _mean([r["test"]["accuracy"] for r in mine]),
            "test_macro_f1": _mean([r["test"]["macro_f1"] for r in mine]),
            "test_macro_f1_sd": _spread([r["test"]["macro_f1"] for r in mine]),
            "test_mcc": _mean([r["test"]["mcc"] for r in mine]),
        }
    ft_cfg = load_config(args.finetune_config, args.finetune_override).finetune
    print("+ bag-of-wordpieces baseline", flush=True)
    bow = bow_baseline(ft_cfg, resolve_checkpoint(str(run_dir)), args.seeds[0])
    margin = mean["pretrained"]["test_macro_f1"] - mean["random"]["test_macro_f1"]
    noise = max(mean["pretrained"]["test_macro_f1_sd"], mean["random"]["test_macro_f1_sd"])
    # "Clear": at least 5 macro-F1 points and well outside the seed-to-seed spread.
    if margin >= max(0.05, 3 * noise):
        verdict = "pretrained wins clearly"
    elif margin > 0:
        verdict = "pretrained ahead, but not by a clear margin"
    else:
        verdict = "pretraining did not help"
    last = json.loads((out / f"random_seed{args.seeds[-1]}" / "summary.json").read_text(encoding="utf-8"))
    result = {
        "task": ft_cfg.task,
        "num_labels": last["task"]["num_labels"],
        "sizes": last["task"]["sizes"],
        "finetune_config": args.finetune_config,
        "finetune_overrides": args.finetune_override,
        "budget": {
            "steps": runs[0]["steps"],
            "batch_size": ft_cfg.batch_size,
            "learning_rate": ft_cfg.learning_rate,
        },
        "pretraining": pretraining,
        "runs": runs,
        "mean": mean,
        "bag_of_wordpieces": bow,
        "margin_test_macro_f1": margin,
        "verdict": verdict,
        "machine": {
            "device": device_name(__import__("torch").device("cpu")),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg_at_end": os.getloadavg(),
        },
        "versions": library_versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(
            [Path(sys.argv[0]).name if argv is None else "finetune_compare.py", *(argv or sys.argv[1:])]
        ),
    }
    atomic_write_json(out / "compare.json", result)
    md = markdown(result)
    atomic_write_text(out / "compare.md", md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
