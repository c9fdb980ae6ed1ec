"""Prepare at corpus scale: every stage of ``bert-mp prepare`` on generated text (1 GB by default), the
vocabulary stage included, against tokenizing the same documents alone in the same run.

The corpus (``bench/generated_text.py``: documents of realistic length, no two alike) is generated
under ``--workdir``, by default in the system's temporary folder. Each measurement is a fresh process
(``TOKENIZERS_PARALLELISM=false`` in all: N processes use N cores), timed from the call of ``prepare``
(or the first encoding) to its end, with the libraries imported before the clock, and sampled for
the peak memory of its whole process tree (``bench/prepare.py``'s ``MemorySampler``: anonymous
memory, which the pipeline holds, apart from the file pages of memory-mapped Arrow files):

1. ``learned``: prepare with a WordPiece vocabulary learned from the corpus (``--vocab-size``,
   ``data.vocab_sample_chars`` at its default): every stage's seconds (``stats.json``), the vocabulary
   stage's (sample + alphabet + training) share of the wall time, peak memory; also for each
   ``--reference-sizes`` corpus (the memory at another size, the same code);
2. ``given``: prepare with the tokenizer that (1) learned as ``data.tokenizer``;
3. ``tokenize``: the same files split into the same documents and batch-encoded by the same tokenizer
   in the same number of processes (``bench/prepare.py``'s tokenize-only);
4. ``tokenize_plain_ascii``: (3) with the encoders prepare uses: its plain-ASCII documents by the
   faster copy of the tokenizer (``bert_mp.data.tokenizer.plain_ascii_encoder``), the others by the
   tokenizer itself.

(2), (3) and (4) run ``--repeat`` times in rotated order; each trial gives the ratio of prepare's
tokens/s to tokenize-only's (3), for the whole prepare and for its tokenize stage
(``split_tokenize_pair``), per wall second and per CPU second, and the same against (4)
(``*_vs_same_encoders``: what prepare's own work beside the encoding costs); the medians are reported. The machine's load average is recorded
with every measurement: on a shared machine absolute seconds are noisy, ratios within a trial less so.

    python scripts/bench/prepare_scale.py --size 1GB --num-proc 2 --reference-sizes 400MB \\
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
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per process on every side
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: its rooms import as packages
from bench.generated_text import manifest, write_generated_corpus  # noqa: E402
from bench.harness import machine_record, write_report  # noqa: E402
from bench.prepare import MemorySampler, parse_size, rotated  # noqa: E402


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def child_prepare(corpus: str, cache: str, overrides: list[str]) -> dict:
    """One prepare in this fresh process (libraries imported first, untimed): wall and CPU seconds,
    stats.json's stages and vocabulary record, peak memory of the process tree."""
    import datasets  # noqa: F401
    from transformers import AutoTokenizer  # noqa: F401

    from bert_mp.core.config import load_config
    from bert_mp.data.prepare import prepare

    cfg = load_config(
        None, ["data.source=text", f"data.paths=[{corpus}]", f"data.cache_dir={cache}", *overrides]
    )
    c0, t0 = _cpu_seconds(), time.perf_counter()
    with MemorySampler() as mem:
        path = prepare(cfg, force=True)
    wall, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
    stats = json.loads((path / "stats.json").read_text())
    return {
        "folder": str(path),
        "seconds": wall,
        "cpu_seconds": cpu,
        "tokens": stats["tokens"],
        "tokens_per_sec": stats["tokens"] / wall,
        "tokens_per_cpu_sec": stats["tokens"] / cpu,
        "stage_seconds": stats["seconds"],
        "vocabulary": stats["vocabulary"],
        "vocabulary_share_of_wall": stats["seconds"]["tokenizer"] / wall if stats["vocabulary"] else None,
        "documents": stats["documents"]["documents_kept"],
        "examples": stats["splits"],
        "memory_peaks_bytes": mem.peak,
        "load_average_after": os.getloadavg(),
    }


def child_tokenize(
    files: list[str], tokenizer: str, num_proc: int, same_malloc: bool, plain_ascii_fast: bool = False
) -> dict:
    """Tokenize-only in this fresh process, timed and sampled as :func:`child_prepare` (wall and CPU
    seconds of the whole process tree): the files split into prepare's documents and batch-encoded
    with the same tokenizer (``bench/prepare.py``'s worker) in ``num_proc`` forked processes;
    ``same_malloc``: under prepare's glibc malloc settings (``bert_mp.data.allocator``);
    ``plain_ascii_fast``: the plain-ASCII documents by prepare's faster encoder, as prepare does."""
    import contextlib
    from multiprocessing import get_context

    from bench.tokenize_only import encode_file, init_worker
    from bert_mp.data import allocator

    init_worker(tokenizer, plain_ascii_fast)  # loaded untimed; forked workers inherit it
    c0, t0 = _cpu_seconds(), time.perf_counter()
    with MemorySampler() as mem, allocator.tuned() if same_malloc else contextlib.nullcontext():
        if num_proc == 1:
            per_file = [encode_file(f) for f in files]
        else:
            with get_context("fork").Pool(num_proc) as pool:  # its start on the clock, as prepare's
                per_file = list(pool.imap_unordered(encode_file, files))
    wall, cpu = time.perf_counter() - t0, _cpu_seconds() - c0  # the pool's workers are reaped by now
    tokens = sum(t for t, _ in per_file)
    return {
        "seconds": wall,
        "cpu_seconds": cpu,
        "tokens": tokens,
        "tokens_per_sec": tokens / wall,
        "tokens_per_cpu_sec": tokens / cpu,
        "same_malloc": same_malloc,
        "plain_ascii_fast": plain_ascii_fast,
        "memory_peaks_bytes": mem.peak,
        "load_average_after": os.getloadavg(),
    }


def _child(kind: str, *args: object) -> dict:
    """``child_<kind>(*args)`` in a fresh process (``TOKENIZERS_PARALLELISM=false``, set above)."""
    r = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps([kind, *args])], capture_output=True, text=True
    )
    if r.returncode != 0:
        raise SystemExit(f"{kind} {args} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


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


def _corpus(args: argparse.Namespace, size: int) -> tuple[Path, dict]:
    folder = args.workdir / f"corpus-{size}"
    write_generated_corpus(folder, size, seed=args.seed)
    return folder, manifest(folder)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1GB", help="the corpus, e.g. 1GB or 20MB")
    p.add_argument(
        "--reference-sizes", nargs="*", default=[], help="corpora measured with (1) only, e.g. 400MB"
    )
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=30522)
    p.add_argument("--repeat", type=int, default=2, help="trials of (2) and (3), in rotated order")
    p.add_argument("--seed", type=int, default=0, help="the generated corpus's seed")
    p.add_argument(
        "--same-malloc", action="store_true", help="also tokenize-only under prepare's malloc settings"
    )
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "bert_mp_prepare_scale")
    p.add_argument("--out", type=Path, default=Path("runs/bench/prepare_scale.json"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        kind, *child_args = json.loads(args.child)
        print(json.dumps((child_prepare if kind == "prepare" else child_tokenize)(*child_args)))
        return 0
    learn = [f"data.vocab_size={args.vocab_size}", f"data.num_proc={args.num_proc}"]
    report: dict = {
        "machine": machine_record("cpu"),
        "command": "python scripts/bench/prepare_scale.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "num_proc": args.num_proc,
        "size": args.size,
        "corpora": {},
        "learned": {},
        "trials": [],
    }
    for text in [*args.reference_sizes, args.size]:
        size = parse_size(text)
        corpus, record = _corpus(args, size)
        report["corpora"][text] = record
        print(f"corpus {text}: {json.dumps(record)}", flush=True)
        report["learned"][text] = row = _child("prepare", str(corpus), str(args.workdir / "cache"), learn)
        print(f"learned {text}: {json.dumps({k: v for k, v in row.items() if k != 'folder'})}", flush=True)
        write_report(report, args.out)
    tokenizer = Path(report["learned"][args.size]["folder"]) / "tokenizer"
    files = [str(f) for f in sorted(corpus.glob("part-*.txt"))]
    given = [f"data.tokenizer={tokenizer}", f"data.num_proc={args.num_proc}"]
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
                got[kind] = _child("prepare", str(corpus), str(args.workdir / "cache"), given)
            else:
                same, plain = kind == "tokenize_same_malloc", kind == "tokenize_plain_ascii"
                got[kind] = _child("tokenize", files, str(tokenizer), args.num_proc, same, plain)
        trial = {"order": list(got), **got}
        trial["ratios"] = _ratios(trial)
        report["trials"].append(trial)
        print(f"trial {r + 1}: {json.dumps(trial['ratios'])}", flush=True)
        write_report(report, args.out)
    report["summary"] = summary(report, args.size)
    write_report(report, args.out)
    print(json.dumps(report["summary"], indent=1))
    return 0


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


if __name__ == "__main__":
    raise SystemExit(main())
