"""Training throughput: a plain Hugging Face loop vs ``bert_mp.pretrain.trainer`` in each available precision.

One run, one machine, one device, one model and batch. The baseline is the obvious loop:
``BertForPreTraining(**batch, labels=..., next_sentence_label=...).loss``, ``torch.optim.AdamW``,
strict fp32 (``--baseline-precisions fp32,bf16`` adds a bf16-autocast HF loop), on batches collated
in advance and already on the device (so it pays nothing for data). Model and batches live on the
same device as bert_mp's (CUDA when available); the device is synchronised only around the timed
window. bert_mp runs its real training
loop (``bert_mp.pretrain.trainer.train``: data loading, masking, logging and all) on the same examples. Both
count non-padding tokens and exclude warm-up steps. ``--repeat`` rounds, each measuring the baseline
and every precision back to back; the median of the per-round ratios is reported. bert_mp runs
with its defaults (on CPU that includes ``model.dropout_impl=auto`` -> fast dropout). Prints a
table and writes JSON.

    python scripts/bench/train.py --preset mini --seq 128 --micro-batch 32 --steps 8 --warmup 3

``--paths padded,unpad,unpad+pack,unpad+compile`` compares encoder paths instead (``model.unpad``,
``data.pack_pairs``, ``train.compile=model``) in the first of ``--precisions``, on prepared corpora
(``--corpus builtin,short``: the built-in documents, or many ~50-token documents generated as in
scripts/bench/prepare.py), each round with the plain HF loop; ratios are taken within a round:

    python scripts/bench/train.py --paths padded,unpad,unpad+pack --preset mini --steps 4 --warmup 1 \
        --repeat 1 --precisions fp32 --corpus builtin,short --out docs/benchmarks/train_unpad_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: its rooms import as packages
from bert_mp.core.process.noise import quiet_libraries  # noqa: E402

quiet_libraries()  # the libraries' chatter off the console, before they load, as `bert-mp` does

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.harness import (  # noqa: E402
    bench_baseline,
    bench_bert_mp,
    corpus_data,
    dropout_kw,
    gemm_rate,
    machine_record,
    synthetic_prepared,
    write_progress,
)

PATHS = {
    # name: (model.unpad, data.pack_pairs, train.compile)
    "padded": (False, False, "none"),
    "unpad": (True, False, "none"),
    "unpad+pack": (True, True, "none"),
    "unpad+compile": (True, False, "model"),
}


def bench_paths(args) -> None:
    """Padded vs unpadded (vs packed, vs compiled) bert_mp and the plain HF loop, per corpus, in one run."""
    from bert_mp.pretrain.batches import epoch_order

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = args.paths.split(",")
    report: dict = {
        **machine_record(device),
        "gemm_rate": args.gemm_rate,
        "setup": {
            "preset": args.preset,
            "seq": args.seq,
            "micro_batch": args.micro_batch,
            "timed_steps": args.steps,
            "warmup_steps": args.warmup,
            "precision": args.precisions.split(",")[0],
            "attention_probs_dropout_prob": args.attention_dropout,
        },
        "note": "tokens/s count real (non-padding) tokens; ratios are within one round of this run "
        "(a shared, loaded machine: absolute figures are not comparable across runs)",
        "corpora": {},
    }
    precision = args.precisions.split(",")[0]
    with tempfile.TemporaryDirectory() as tmp:
        for corpus in args.corpus.split(","):
            data, data_cfg = corpus_data(corpus, args, Path(tmp))
            args.data_cfg, args.vocab = data_cfg, int(data.stats["model_vocab_size"])
            n = len(data.dataset["train"])
            need = (args.warmup + args.steps) * args.micro_batch  # small corpora: the next epochs' orders
            order = np.concatenate([epoch_order(n, 42, e) for e in range(-(-need // n))])
            rounds = []
            for r in range(0 if args.interleaved_only else args.repeat):
                res: dict = {}
                runs = ["baseline", *names]
                for name in runs if r % 2 == 0 else runs[::-1]:
                    if name == "baseline":
                        res["baseline_hf_fp32"] = bench_baseline(data, args, order, device, "fp32")
                        continue
                    unpad, pack, comp = PATHS[name]
                    from dataclasses import replace

                    res[name] = bench_bert_mp(
                        data,
                        args,
                        precision,
                        Path(tmp) / f"{corpus}_{name}_{r}",
                        data_cfg=replace(data_cfg, pack_pairs=pack),
                        unpad=unpad,
                        compile_mode=comp,
                    )
                    # every path lands in the JSON the moment it is measured (a cut keeps it)
                    report["corpora"].setdefault(corpus, {})["partial_round"] = {"round": r, **res}
                    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
                for v in res.values():
                    v["ratio_vs_baseline"] = v["tokens_per_sec"] / res["baseline_hf_fp32"]["tokens_per_sec"]
                    if "padded" in res:
                        v["ratio_vs_padded"] = v["tokens_per_sec"] / res["padded"]["tokens_per_sec"]
                rounds.append(res)
                print(
                    f"{corpus} round {r + 1}/{args.repeat}: "
                    + ", ".join(
                        f"{k} {v['tokens_per_sec']:.0f} tok/s ({v.get('ratio_vs_padded', 0):.2f}x padded)"
                        for k, v in res.items()
                    ),
                    flush=True,
                )
            summary = (
                {}
                if not rounds
                else {
                    k: {
                        "tokens_per_sec_median": statistics.median(rd[k]["tokens_per_sec"] for rd in rounds),
                        "ratio_vs_padded_median": statistics.median(
                            rd[k].get("ratio_vs_padded", float("nan")) for rd in rounds
                        ),
                        "ratio_vs_baseline_median": statistics.median(
                            rd[k]["ratio_vs_baseline"] for rd in rounds
                        ),
                        "mfu_median": rounds[0][k].get("mfu"),
                        "compiled_graphs": rounds[0][k].get("compiled_graphs"),
                    }
                    for k in rounds[0]
                }
            )
            if args.interleaved_steps:
                inter = SimpleNamespace(**{**vars(args), "steps": args.interleaved_steps})
                eager = [n for n in names if PATHS[n][2] == "none"]
                precs = tuple(args.interleaved_precisions.split(","))
                interleaved = bench_interleaved(data, data_cfg, inter, eager, order, precs)
                print(
                    f"{corpus} interleaved (CPU seconds): "
                    + ", ".join(
                        f"{k} {v['ratio_vs_padded_cpu']:.2f}x padded"
                        for k, v in interleaved.items()
                        if isinstance(v, dict)
                    ),
                    flush=True,
                )
            else:
                interleaved = None
            report["corpora"][corpus] = {
                "interleaved_model_steps": interleaved,
                "padding_fraction_at_max_seq_length": (
                    (data.stats.get("per_split") or {}).get("train") or {}
                ).get("padding_fraction_at_max_seq_length"),
                "train_examples": n,
                "summary": summary,
                "rounds": rounds,
            }
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")  # after each corpus
    report["load_average_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    for corpus, c in report["corpora"].items():
        print(f"{corpus}: padding {c['padding_fraction_at_max_seq_length']}")
        for k, v in c["summary"].items():
            print(
                f"  {k:<18} {v['tokens_per_sec_median']:>9.0f} tok/s  {v['ratio_vs_padded_median']:.2f}x padded  {v['ratio_vs_baseline_median']:.2f}x HF"
            )
    print(f"wrote {args.out}")


def bench_interleaved(
    data, data_cfg, args, names: list[str], order: np.ndarray, precisions: tuple[str, ...] = ("fp32",)
) -> dict:
    """Forward, backward and AdamW step of each path on the same pre-collated micro-batches, the paths
    taking turns step by step (rotating who goes first), timed in wall and in process CPU seconds.
    ``precisions``: fp32 (keys as the path names) and/or bf16 (CPU autocast, keys ``<path>_bf16``,
    ratios against the padded path and the HF loop of the same precision, and ``ratio_vs_fp32_*``
    against the same path in fp32).

    On a machine shared with other work the turns put every path through the same load phases, and
    CPU seconds do not count the time the process waited for a core: the ratios of this section are
    the steadier ones. Same model init and, on CPU, the fast dropout the trainer uses.
    """
    from dataclasses import replace

    from transformers import BertForPreTraining

    from bert_mp.core.config import ModelConfig
    from bert_mp.data.masking import PretrainingCollator
    from bert_mp.model.bert import PretrainingModel, bert_config
    from bert_mp.model.dropout import install_fast_dropout
    from bert_mp.model.unpad import collate_layout

    ds, mb, total = data.dataset["train"], args.micro_batch, args.warmup + args.steps
    feats = [
        [{**ds[int(i)], "index": int(i), "epoch": 0} for i in order[s * mb : (s + 1) * mb]]
        for s in range(total)
    ]
    runs = {}
    for prec in precisions:
        if prec not in ("fp32", "bf16"):
            raise SystemExit(f"--interleaved-precisions {prec}: choose fp32 and/or bf16")
        for name in ["baseline", *names]:
            unpad, pack, _ = PATHS.get(name, (False, False, "none"))
            torch.manual_seed(0)
            model = BertForPreTraining(
                bert_config(ModelConfig(preset=args.preset, **dropout_kw(args)), vocab_size=args.vocab)
            )
            if name != "baseline":
                install_fast_dropout(model)
                model = PretrainingModel(model, unpad=unpad)
            # as the trainer does: an unpadded model's layout comes with its batches (untimed, like the
            # padding and masking of every path)
            layout = collate_layout(model) if unpad and name != "baseline" else None
            collate = PretrainingCollator(
                data.tokenizer, replace(data_cfg, pack_pairs=pack), seed=42, layout=layout
            )
            runs[name if prec == "fp32" else f"{name}_{prec}"] = {
                "model": model.train(),
                "opt": torch.optim.AdamW(model.parameters(), lr=1e-4),
                "batches": [collate(f) for f in feats],
                "bf16": prec == "bf16",
                "wall": [],
                "cpu": [],
            }
    for step in range(total):
        turn = list(runs)[step % len(runs) :] + list(runs)[: step % len(runs)]
        for name in turn:
            r, batch = runs[name], runs[name]["batches"][step]
            w0, c0 = time.perf_counter(), time.process_time()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=r["bf16"]):
                if name.startswith("baseline"):
                    loss = r["model"](**{k: v for k, v in batch.items() if k != "segment_ids"}).loss
                else:
                    o = r["model"](**batch)
                    n_masked = max(float((batch["labels"] != -100).sum()), 1.0)
                    loss = o["mlm_loss_sum"] / n_masked + o["nsp_loss_sum"] / mb
            loss.backward()
            r["opt"].step()
            r["opt"].zero_grad()
            if step >= args.warmup:
                r["wall"].append(time.perf_counter() - w0)
                r["cpu"].append(time.process_time() - c0)
    tokens = sum(int(b["attention_mask"].sum()) for b in runs["baseline"]["batches"][args.warmup :])
    padded = sum(b["attention_mask"].numel() for b in runs["baseline"]["batches"][args.warmup :])
    out: dict = {"real_tokens": tokens, "batch_padding_fraction": 1 - tokens / padded}
    for name, r in runs.items():
        out[name] = {
            "tokens_per_wall_sec": tokens / sum(r["wall"]),
            "tokens_per_cpu_sec": tokens / sum(r["cpu"]),
        }
    for name in runs:
        suffix = "_bf16" if runs[name]["bf16"] else ""
        ref = out.get(f"padded{suffix}") or out[f"baseline{suffix}"]
        fp32 = out.get(name.removesuffix(suffix)) if suffix else None
        for unit in ("wall", "cpu"):
            key = f"tokens_per_{unit}_sec"
            out[name][f"ratio_vs_padded_{unit}"] = out[name][key] / ref[key]
            out[name][f"ratio_vs_baseline_{unit}"] = out[name][key] / out[f"baseline{suffix}"][key]
            if fp32:
                out[name][f"ratio_vs_fp32_{unit}"] = out[name][key] / fp32[key]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="mini")
    p.add_argument("--vocab", type=int, default=30522, help="tokenizer size (BERT's own: 30522)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=8, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per run")
    p.add_argument("--precisions", default="fp32,tf32,bf16,fp16")
    p.add_argument("--dropout-impl", default="auto", help="bert_mp's model.dropout_impl (auto, fast, torch)")
    p.add_argument("--repeat", type=int, default=3, help="rounds (median ratio reported)")
    p.add_argument(
        "--allow-emulated",
        action="store_true",
        help="run bf16/fp16 on a CPU without native support (hardware.allow_emulated): numerics, not speed",
    )
    p.add_argument(
        "--device", default="auto", help="auto (cuda if available), cuda or cpu; both sides run there"
    )
    p.add_argument("--compile", default="none", help="bert_mp's train.compile (none, model, layers)")
    p.add_argument("--attn-implementation", default="sdpa", help="bert_mp's model.attn_implementation")
    p.add_argument(
        "--baseline-precisions", default="fp32", help="plain HF loop precisions: fp32 and/or bf16 (autocast)"
    )
    p.add_argument(
        "--attention-dropout",
        type=float,
        default=None,
        help="model.attention_probs_dropout_prob for every model of the run (0: the unpadded path may use "
        "torch's varlen flash kernel on CUDA); default: the preset's",
    )
    p.add_argument("--out", default="runs/bench_train.json")
    p.add_argument(
        "--paths",
        default=None,
        help=f"compare encoder paths instead of precisions (first of --precisions): any of {', '.join(PATHS)}",
    )
    p.add_argument(
        "--corpus",
        default="builtin,short",
        help="with --paths: prepared corpora (builtin, short) or synthetic rows (a rehearsal)",
    )
    p.add_argument("--corpus-bytes", type=int, default=400_000, help="with --paths: size of the short corpus")
    p.add_argument(
        "--interleaved-only", action="store_true", help="with --paths: skip the training-loop runs"
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument(
        "--interleaved-steps",
        type=int,
        default=0,
        help="with --paths: also time this many model steps per path taking turns (wall and CPU seconds)",
    )
    p.add_argument(
        "--interleaved-precisions",
        default="fp32",
        help="with --interleaved-steps: fp32 and/or bf16 (CPU autocast) rows of every path",
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # the second ceiling of every bert_mp row: this machine's own bf16 GEMM rate, measured here first
    args.gemm_rate = gemm_rate()
    args.gemm_flops = args.gemm_rate["flops_per_sec"]
    if args.paths:
        import sys

        args.argv = sys.argv[1:]
        return bench_paths(args)

    from bert_mp.core.numerics.precision import resolve_precision
    from bert_mp.errors import HardwareError

    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    if device.type != ("cuda" if torch.cuda.is_available() else "cpu"):
        raise SystemExit(
            f"--device {args.device}: bert_mp trains on CUDA whenever it is available, so both sides "
            "can only be compared on that device here"
        )
    n = args.micro_batch * (args.warmup + args.steps)
    model_vocab = -(-args.vocab // 64) * 64  # what `bert-mp prepare` gives the model (multiple of 64)
    data = synthetic_prepared(n, args.seq, args.vocab, model_vocab)
    # bert_mp's sampler order for its seed/epoch 0, so the baseline sees the same examples
    from bert_mp.pretrain.batches import epoch_order

    order = epoch_order(n, 42, 0)
    load_before = os.getloadavg()
    precisions = args.precisions.split(",")
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeat):
            # Each round measures the baseline and every precision back to back (baseline first in
            # even rounds, last in odd ones); ratios are taken within a round, so a slow or fast
            # phase of a shared machine hits both sides of a ratio.
            res: dict = {}
            baselines = [f"baseline:{b}" for b in args.baseline_precisions.split(",")]
            names = [*baselines, *precisions]
            for name in names if r % 2 == 0 else names[::-1]:
                if name.startswith("baseline:"):
                    bp = name.split(":", 1)[1]
                    try:
                        res[f"baseline_hf_{bp}"] = bench_baseline(data, args, order, device, bp)
                    except HardwareError as e:
                        res[f"baseline_hf_{bp}"] = {"skipped": str(e)}
                    write_progress(args.out, device, rounds, res)
                    continue
                try:
                    resolve_precision(name, device, allow_emulated=args.allow_emulated)
                except HardwareError as e:
                    res[f"bert_mp_{name}"] = {"skipped": str(e)}
                    continue
                res[f"bert_mp_{name}"] = bench_bert_mp(data, args, name, Path(tmp) / f"{name}_{r}")
                write_progress(args.out, device, rounds, res)
            # ratios against the strict-fp32 HF loop (or the first baseline that ran)
            ref = res.get("baseline_hf_fp32") or next(
                v for k, v in res.items() if k.startswith("baseline_hf_")
            )
            base = ref["tokens_per_sec"]
            for v in res.values():
                if "tokens_per_sec" in v:
                    v["ratio_vs_baseline"] = v["tokens_per_sec"] / base
            rounds.append(res)
            print(
                f"round {r + 1}/{args.repeat}: "
                + ", ".join(
                    f"{k} {v['ratio_vs_baseline']:.2f}x" for k, v in res.items() if "ratio_vs_baseline" in v
                ),
                flush=True,
            )
    results: dict = {}
    for name in rounds[0]:
        runs = [rd[name] for rd in rounds]
        if "skipped" in runs[0]:
            results[name] = runs[0]
            continue
        ratios = sorted(x["ratio_vs_baseline"] for x in runs)
        results[name] = {
            "tokens_per_sec": statistics.median(x["tokens_per_sec"] for x in runs),
            "step_ms": statistics.median(x["step_ms"] for x in runs),
            "ratio_vs_baseline": statistics.median(ratios),
            "ratio_min_max": [ratios[0], ratios[-1]],
            **{
                k: v
                for k, v in runs[0].items()
                if k not in ("tokens_per_sec", "step_ms", "ratio_vs_baseline")
            },
        }

    report = {
        **machine_record(device),
        "gemm_rate": args.gemm_rate,
        "device_type": device.type,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "setup": {
            "preset": args.preset,
            "tokenizer_vocab": args.vocab,
            "baseline_model_vocab": args.vocab,
            "bert_mp_model_vocab": model_vocab,
            "seq": args.seq,
            "micro_batch": args.micro_batch,
            "timed_steps": args.steps,
            "warmup_steps": args.warmup,
            "bert_mp_dropout_impl": args.dropout_impl,
        },
        "repeat": args.repeat,
        "results": results,
        "rounds": rounds,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"device: {report['device']} ({report['cpu_threads']} threads), load avg {load_before[0]:.2f}")
    print(f"medians of {args.repeat} rounds")
    print(f"{'run':<20} {'tokens/s':>10} {'step ms':>9} {'x baseline':>11} {'min-max':>12}")
    for name, r in results.items():
        if "skipped" in r:
            print(f"{name:<20} skipped: {r['skipped']}")
        else:
            lo, hi = r["ratio_min_max"]
            print(
                f"{name:<20} {r['tokens_per_sec']:>10.0f} {r['step_ms']:>9.1f} {r['ratio_vs_baseline']:>10.2f}x"
                f" {lo:>6.2f}-{hi:.2f}"
            )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
