"""Benchmark `bert-mp prepare` against batch-encoding alone, on the same files and cores, in one of
two modes. Every measurement is a fresh process (``TOKENIZERS_PARALLELISM=false`` in all, so N
processes use N cores), timed from the call of ``prepare`` (or the first encoding) to its end with the
libraries imported before the clock, and sampled for the peak memory of its process tree (a thread
reading ``/proc`` every 0.2 s on both sides: anonymous memory, which the pipeline holds, apart from
the file pages of memory-mapped Arrow files). Ratios are per wall second and per CPU second (user +
system of the process tree; on a shared, loaded machine the steadier of the two). A trial's kinds run
back to back in rotated order and the median of the per-trial ratios is reported, so a slow or fast
phase of a shared machine hits both sides of a pair. Writes JSON (``--out``, with every trial).

``--mode shapes`` (default): corpus shapes written from the built-in corpus (``--shapes``), a
WordPiece tokenizer trained once, untimed; for each shape and ``--num-proc``:

  (a) prepare: read, split sentences, tokenize, pair, mask, write (``bert_mp.data.prepare.prepare``
      with ``data.tokenizer`` pointing at the trained tokenizer);
  (b) tokenize-only: the same files split into the same documents and ``encode_batch_fast`` with the
      same Rust tokenizer in N processes (a forked pool, its start on the clock as prepare's is;
      ``ratio_pool_untimed`` gives the ratio without it);
  (c) tokenize-only under prepare's glibc malloc settings (``bert_mp.data.allocator``):
      ``ratio_same_malloc``, like for like (``ratio`` counts the allocator for prepare).

    python scripts/bench/prepare.py --size 50MB --num-proc 1 2
    python scripts/bench/prepare.py --size 400MB --shapes builtin one-line --prepare-only  # memory

``--prepare-only`` measures (a) alone; with the ``one-line`` shape it prints the ratio of the peaks of
anonymous memory of one document without a line break against many documents.

``--mode scale``: generated text of realistic documents (``bench/generated_text.py``, 1 GB by
default, under ``--workdir``), the vocabulary stage included:

1. ``learned``: prepare learning a WordPiece vocabulary from the corpus (``--vocab-size``): every
   stage's seconds, the vocabulary stage's share of the wall time, peak memory; also for each
   ``--reference-sizes`` corpus (the memory at another size);
2. ``given``: prepare with the tokenizer that (1) learned; 3. ``tokenize``: tokenize-only as (b);
4. ``tokenize_plain_ascii``: (3) with the encoders prepare uses (plain-ASCII documents by the faster
   copy of the tokenizer, ``*_vs_same_encoders``); ``--same-malloc`` adds (3) under prepare's malloc.

    python scripts/bench/prepare.py --mode scale --size 1GB --num-proc 2 --reference-sizes 400MB \\
        --out docs/benchmarks/prepare_scale_1GB.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: its rooms import as packages
from bert_mp.core.process.noise import quiet_libraries  # noqa: E402

quiet_libraries()
from bench import prepare_parts as parts  # noqa: E402
from bench.generated_text import manifest, write_generated_corpus  # noqa: E402
from bench.harness import machine_record, write_report  # noqa: E402
from bench.prepare_parts import SHAPES, ensure_tokenizer, parse_size, rotated, write_corpus  # noqa: E402

KINDS = ("tokenize", "prepare", "tokenize-same-malloc")
"""The measured children of a shapes trial, run in rotated order."""
DEFAULTS = {  # per mode: --size, --num-proc, --vocab-size, --repeat, --workdir, --out
    "shapes": ("50MB", [1, 2], 8192, 3, Path("runs/bench/prepare_work"), Path("runs/bench/prepare.json")),
    "scale": ("1GB", [2], 30522, 2, Path(tempfile.gettempdir()) / "bert_mp_prepare_scale",
              Path("runs/bench/prepare_scale.json")),
}  # fmt: skip


def child(kind: str, *args: object) -> dict:
    """``parts.child_<kind>(*args)`` in a fresh process."""
    r = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps([kind, *args])], capture_output=True, text=True
    )
    if r.returncode != 0:
        raise SystemExit(f"{kind} {args} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def one_line_ratios(rows: list[dict]) -> dict[str, float]:
    """The one-line shape's peak anonymous memory (process tree) over each other shape's, per num_proc."""
    anon = {(r["shape"], r["num_proc"]): r["prepare"]["memory_peaks_bytes"]["anon_total"] for r in rows}
    return {
        f"one-line / {shape}, num_proc={n}": anon["one-line", n] / peak
        for (shape, n), peak in anon.items()
        if shape != "one-line" and ("one-line", n) in anon
    }


def run_shapes(args: argparse.Namespace, report: dict) -> None:
    size = parse_size(args.size)
    tokenizer = ensure_tokenizer(args.workdir / "tokenizer", args.vocab_size)
    corpora = {}
    for shape in args.shapes:
        source = parts._shape_source(shape)
        corpora[shape] = write_corpus(args.workdir / f"corpus-{source}", size, shape)
        files = corpora[shape]
        print(
            f"corpus {shape}: {len(files)} files, {sum(f.stat().st_size for f in files) / 1e6:.1f} MB "
            f"({SHAPES[shape][0]}); tokenizer: {tokenizer}",
            flush=True,
        )

    rows = []
    for shape in args.shapes:
        files = corpora[shape]
        extra = [*SHAPES[shape][1], *args.extra]
        for n in args.num_proc:
            trials = []
            for r in range(args.repeat):
                kinds = list(KINDS)
                if args.no_same_malloc_baseline:
                    kinds.remove("tokenize-same-malloc")
                if args.prepare_only:
                    kinds = ["prepare"]
                order = tuple(rotated(kinds, r))
                got = {kind: _shapes_child(kind, args, files, tokenizer, n, extra) for kind in order}
                prep = got["prepare"]
                tok = got.get("tokenize") or {
                    "tokens_per_sec": float("nan"),
                    "tokens_per_cpu_sec": float("nan"),
                }
                trial = {
                    "order": list(order),
                    "load_average_1min": os.getloadavg()[0],
                    "tokenize_only": tok,
                    "prepare": prep,
                    "ratio": prep["tokens_per_sec"] / tok["tokens_per_sec"],
                    "cpu_ratio": prep["tokens_per_cpu_sec"] / tok["tokens_per_cpu_sec"],
                    "ratio_pool_untimed": prep["tokens_per_sec"]
                    * tok.get("seconds_pool_untimed", float("nan"))
                    / tok.get("tokens", float("nan")),
                }
                if "tokenize-same-malloc" in got:
                    trial["tokenize_only_same_malloc"] = same = got["tokenize-same-malloc"]
                    trial["ratio_same_malloc"] = prep["tokens_per_sec"] / same["tokens_per_sec"]
                trials.append(trial)
                print(
                    f"{shape} num_proc={n} trial {r + 1}/{args.repeat}: tokenize-only "
                    f"{tok['tokens_per_sec']:,.0f} tok/s, prepare {prep['tokens_per_sec']:,.0f} tok/s, "
                    f"ratio {trial['ratio']:.2f} (per CPU second: {trial['cpu_ratio']:.2f}; "
                    f"same malloc: {trial.get('ratio_same_malloc', float('nan')):.2f})",
                    flush=True,
                )
            ratios = sorted(t["ratio"] for t in trials)
            median = statistics.median(ratios)
            mid = min(trials, key=lambda t: abs(t["ratio"] - median))  # the trial shown in the table
            rows.append(
                {
                    "shape": shape,
                    "shape_description": SHAPES[shape][0],
                    "overrides": extra,
                    "corpus_bytes": sum(f.stat().st_size for f in files),
                    "files": len(files),
                    "num_proc": n,
                    "ratio": median,
                    "cpu_ratio": statistics.median(t["cpu_ratio"] for t in trials),
                    "ratio_pool_untimed": statistics.median(t["ratio_pool_untimed"] for t in trials),
                    "ratio_same_malloc": statistics.median(
                        t.get("ratio_same_malloc", float("nan")) for t in trials
                    ),
                    # best of the trials on each side (the least disturbed CPU time, as timeit reports)
                    "cpu_ratio_best": max(t["prepare"]["tokens_per_cpu_sec"] for t in trials)
                    / max(t["tokenize_only"]["tokens_per_cpu_sec"] for t in trials),
                    "ratio_min_max": [ratios[0], ratios[-1]],
                    "mean_example_length": mid["prepare"]["mean_example_length"],
                    "padding_fraction_at_max_seq_length": mid["prepare"][
                        "padding_fraction_at_max_seq_length"
                    ],
                    "tokenize_only": mid["tokenize_only"],
                    "prepare": mid["prepare"],
                    "trials": trials,
                }
            )

    print()
    head = (
        "shape",
        "num_proc",
        "tokenize tok/s",
        "prepare tok/s",
        "median ratio",
        "min-max",
        "cpu ratio",
        "no-pool ratio",
        "same-malloc",
        "prep s",
        "peak RSS MB",
        "anon peak MB",
        "padding",
        "mean length",
    )
    print("  ".join(f"{h:>14}" for h in head))
    for r in rows:
        cells = (
            r["shape"],
            r["num_proc"],
            f"{r['tokenize_only']['tokens_per_sec']:,.0f}",
            f"{r['prepare']['tokens_per_sec']:,.0f}",
            f"{r['ratio']:.2f}",
            "{:.2f}-{:.2f}".format(*r["ratio_min_max"]),
            f"{r['cpu_ratio']:.2f}",
            f"{r['ratio_pool_untimed']:.2f}",
            f"{r['ratio_same_malloc']:.2f}",
            f"{r['prepare']['seconds']:.1f}",
            f"{max(r['prepare']['peak_rss'].values()) / 1e6:.0f}",
            f"{r['prepare']['memory_peaks_bytes']['anon_total'] / 1e6:.0f}",
            f"{r['padding_fraction_at_max_seq_length']:.1%}",
            f"{r['mean_example_length']:.1f}",
        )
        print("  ".join(f"{c:>14}" for c in cells))
    for key, ratio in one_line_ratios(rows).items():  # the long-document check
        print(f"peak anonymous memory of the process tree, {key}: {ratio:.2f}")
    report.update(size_per_shape_bytes=size, extra_overrides=args.extra, results=rows)
    report["anon_peak_ratios"] = one_line_ratios(rows)


def _shapes_child(
    kind: str, args: argparse.Namespace, files: list[Path], tokenizer: Path, num_proc: int, extra: list[str]
) -> dict:
    paths = [str(f) for f in files]
    if kind == "prepare":
        overrides = [f"data.tokenizer={tokenizer}", f"data.num_proc={num_proc}", *extra]
        return child("prepare", paths, str(args.workdir / "cache"), overrides)
    whole_file = "data.documents=file" in extra
    return child("tokenize", paths, str(tokenizer), num_proc, whole_file, kind == "tokenize-same-malloc")


def run_scale(args: argparse.Namespace, report: dict) -> None:
    num_proc = args.num_proc[0]
    learn = [f"data.vocab_size={args.vocab_size}", f"data.num_proc={num_proc}"]
    report.update(num_proc=num_proc, size=args.size, corpora={}, learned={}, trials=[])
    cache = str(args.workdir / "cache")
    for text in [*args.reference_sizes, args.size]:
        corpus = args.workdir / f"corpus-{parse_size(text)}"
        write_generated_corpus(corpus, parse_size(text), seed=args.seed)
        report["corpora"][text] = record = manifest(corpus)
        print(f"corpus {text}: {json.dumps(record)}", flush=True)
        report["learned"][text] = row = child("prepare", [str(corpus)], cache, learn)
        print(f"learned {text}: {json.dumps({k: v for k, v in row.items() if k != 'folder'})}", flush=True)
        write_report(report, args.out)
    tokenizer = Path(report["learned"][args.size]["folder"]) / "tokenizer"
    files = [str(f) for f in sorted(corpus.glob("part-*.txt"))]
    given = [f"data.tokenizer={tokenizer}", f"data.num_proc={num_proc}"]
    kinds = [
        "given",
        "tokenize",
        "tokenize_plain_ascii",
        *(["tokenize_same_malloc"] if args.same_malloc else []),
    ]
    for r in range(args.repeat):
        got = {}
        for kind in rotated(kinds, r):
            if kind == "given":
                got[kind] = child("prepare", [str(corpus)], cache, given)
            else:
                same, plain = kind == "tokenize_same_malloc", kind == "tokenize_plain_ascii"
                got[kind] = child("tokenize", files, str(tokenizer), num_proc, False, same, plain)
        trial = {"order": list(got), **got}
        trial["ratios"] = _ratios(trial)
        report["trials"].append(trial)
        print(f"trial {r + 1}: {json.dumps(trial['ratios'])}", flush=True)
        write_report(report, args.out)
    report["summary"] = summary(report, args.size)
    print(json.dumps(report["summary"], indent=1))


def _ratios(trial: dict) -> dict:
    """prepare (given tokenizer) against tokenize-only: the whole prepare and its tokenize stage
    (``split_tokenize_pair``: split, tokenize, pair and join, the pool's start included), per wall
    second and per CPU second of the process tree; and the whole against tokenize-only under the
    same malloc settings, where measured."""
    given, tok = trial["given"], trial["tokenize"]
    stage = given["stage_seconds"]["split_tokenize_pair"]
    out = {
        "whole": given["tokens_per_sec"] / tok["tokens_per_sec"],
        "tokenize_stage": given["tokens"] / stage / tok["tokens_per_sec"],
        "whole_cpu": given["tokens_per_cpu_sec"] / tok["tokens_per_cpu_sec"],
        "same_tokens": given["tokens"] == tok["tokens"],
    }
    if "tokenize_plain_ascii" in trial:  # against tokenizing with the encoders prepare uses
        same = trial["tokenize_plain_ascii"]
        out["whole_vs_same_encoders"] = given["tokens_per_sec"] / same["tokens_per_sec"]
        out["tokenize_stage_vs_same_encoders"] = given["tokens"] / stage / same["tokens_per_sec"]
        out["whole_cpu_vs_same_encoders"] = given["tokens_per_cpu_sec"] / same["tokens_per_cpu_sec"]
    if "tokenize_same_malloc" in trial:
        out["whole_same_malloc"] = given["tokens_per_sec"] / trial["tokenize_same_malloc"]["tokens_per_sec"]
    return out


def summary(report: dict, size: str) -> dict:
    """The acceptance figures: the vocabulary stage's share, peak memory against the reference
    sizes, and the median ratios of prepare with a given tokenizer to tokenize-only."""
    learned = report["learned"][size]
    peaks = {k: v["memory_peaks_bytes"]["anon_total"] for k, v in report["learned"].items()}
    keys = [k for k in (report["trials"] or [{"ratios": {}}])[0]["ratios"] if k != "same_tokens"]
    ratios = {k: statistics.median(t["ratios"][k] for t in report["trials"]) for k in keys}
    return {
        "vocabulary_seconds": learned["stage_seconds"]["tokenizer"],
        "vocabulary_parts_seconds": learned["vocabulary"]["seconds"],
        "prepare_seconds": learned["seconds"],
        "vocabulary_share_of_wall": learned["vocabulary_share_of_wall"],
        "stage_seconds": learned["stage_seconds"],
        "peak_anon_bytes": peaks,
        "peak_anon_ratio_to_references": {k: peaks[size] / v for k, v in peaks.items() if k != size},
        "given_tokenizer_ratio_median": ratios,
        "given_tokenizer_ratio_per_trial": [t["ratios"] for t in report["trials"]],
        "load_average_per_trial": [t["tokenize"]["load_average_after"] for t in report["trials"]],
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["shapes", "scale"], default="shapes", help="see the docstring")
    p.add_argument("--size", help="corpus size (per shape), e.g. 13MB, 50MB or 1GB (shapes 50MB, scale 1GB)")
    p.add_argument("--num-proc", type=int, nargs="+", help="data.num_proc values (shapes 1 2; scale: one, 2)")
    p.add_argument("--vocab-size", type=int, help="WordPiece vocabulary (shapes 8192, scale 30522)")
    p.add_argument(
        "--repeat", type=int, help="trials, in rotated order; medians reported (shapes 3, scale 2)"
    )
    p.add_argument("--workdir", type=Path, help="corpora, tokenizer and caches")
    p.add_argument(
        "--out", type=Path, help="the JSON (runs/bench/prepare.json, runs/bench/prepare_scale.json)"
    )
    shapes = p.add_argument_group("--mode shapes")
    shapes.add_argument(
        "--shapes",
        nargs="+",
        default=["builtin"],
        choices=list(SHAPES),
        help="; ".join(f"{k}: {v[0]}" for k, v in SHAPES.items()),
    )
    shapes.add_argument("--prepare-only", action="store_true", help="prepare alone: peak memory only")
    shapes.add_argument("--extra", nargs="*", default=[], help="extra data.* overrides for prepare")
    shapes.add_argument("--no-same-malloc-baseline", action="store_true", help="skip (c)")
    scale = p.add_argument_group("--mode scale")
    scale.add_argument("--reference-sizes", nargs="*", default=[], help="corpora measured with (1) only")
    scale.add_argument("--seed", type=int, default=0, help="the generated corpus's seed")
    scale.add_argument("--same-malloc", action="store_true", help="also tokenize-only under prepare's malloc")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.child:
        kind, *child_args = json.loads(args.child)
        print(json.dumps(getattr(parts, f"child_{kind}")(*child_args)))
        return 0
    for key, default in zip(
        ("size", "num_proc", "vocab_size", "repeat", "workdir", "out"), DEFAULTS[args.mode]
    ):
        if getattr(args, key) is None:
            setattr(args, key, default)
    report = machine_record("cpu")
    report["mode"] = args.mode
    (run_scale if args.mode == "scale" else run_shapes)(args, report)
    write_report(report, args.out)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
