"""Benchmark `bert-mp prepare` against batch-encoding alone, on the same files and cores.

Writes the built-in corpus out as text files (documents separated by blank lines), repeated up to
``--size``; trains (or reuses) a WordPiece tokenizer once, untimed; then for each ``--num-proc``
times, each in a fresh subprocess (so peak RSS is per measurement):

  (a) prepare: read, split sentences, tokenize, pair, mask (static only), write - the real
      ``bert_mp.data.prepare.prepare`` with ``data.tokenizer`` pointing at the trained tokenizer;
  (b) tokenize-only: read the same files, split them into the same documents, and
      ``encode_batch_fast`` them with the same Rust tokenizer in N processes (a forked pool, its
      start on the clock as prepare's is; ``ratio_pool_untimed`` gives the ratio without it);
  (c) tokenize-only again under the glibc malloc settings that prepare runs with
      (``bert_mp.data.allocator``): ``ratio_same_malloc`` is prepare against this one, the
      like-for-like ratio (the allocator speeds both sides; ``ratio`` counts it for prepare).

Both count tokens of the text (no [CLS]/[SEP]) and run with TOKENIZERS_PARALLELISM=false, so N
processes use N cores in both; both run the same memory sampler (a thread reading ``/proc`` every
0.2 s), so its cost is on both clocks. The ratio is given per wall second and per CPU second (user +
system of all processes): on a shared, loaded machine the CPU ratio is the steadier of the two.
The trial (a, b, c) is measured ``--repeat`` times, back to back and in rotated order, and the
median of the per-trial ratios is reported: a slow or fast phase of a shared machine then hits
both sides of a pair, not one side of the whole comparison. Prints a table and writes JSON
(``--out``, with every trial).

    python scripts/bench/prepare.py --size 50MB --num-proc 1 2

Memory with one long document: ``--shapes builtin one-line --prepare-only`` prepares the corpus as
many documents and as one document without a line break, and prints (and writes) the ratio of the
two peaks of anonymous memory of the process tree.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per process on both sides
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: its rooms import as packages
from bert_mp.core.process.noise import quiet_libraries  # noqa: E402

quiet_libraries()  # the libraries' chatter off the console, before they load, as `bert-mp` does

from bench.tokenize_only import encode_file as _encode_file  # noqa: E402
from bench.tokenize_only import init_worker as _init_worker  # noqa: E402

FILE_BYTES = 2_000_000

KINDS = ("tokenize", "prepare", "tokenize-same-malloc")
"""The measured children of a trial, run in rotated order: tokenize-only (the baseline of the
ratio), prepare, and tokenize-only again under prepare's malloc settings (``ratio_same_malloc``:
prepare against a baseline that gets the same allocator, so a faster allocator is not counted as
less pipeline overhead)."""


def rotated(kinds: list[str], trial: int) -> list[str]:
    """The measured kinds of trial ``trial`` (from 0), rotated: over ``len(kinds)`` trials each kind runs
    first once, so none always meets the machine first (cold caches, a settling CPU clock)."""
    return [kinds[(trial + i) % len(kinds)] for i in range(len(kinds))]


def parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    t = text.strip().upper()
    for u, m in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * m)
    return int(t)


SHAPES = {
    # name: (what it is, data.* overrides prepare runs with)
    "builtin": ("built-in documents (a module's docstrings each), paragraphs folded into lines", ()),
    "short": ("many short documents of ~50 tokens (2-3 sentences), blank-line separated", ()),
    "long": ("few very long documents (one per ~1.3 MB file, no blank line inside)", ()),
    "line": (
        "Google's format: one sentence per line, blank line between documents",
        ("data.documents=line",),
    ),
    "books": ("~140 KB book files of verse and prose: many short paragraphs", ()),
    "one-line": ("one document of the whole size in one file, without a line break", ()),
    "books-file": ("the books corpus read with one file = one document", ("data.documents=file",)),
}
"""Corpus shapes, all generated locally from the built-in corpus (offline, the same text on every run)."""

BOOK_BYTES = 140_000
LONG_BYTES = 1_300_000


def _shape_source(shape: str) -> str:
    return "books" if shape == "books-file" else shape


def _builtin_sentences() -> list[list[str]]:
    """The built-in documents as lists of sentences (rule splitter), newlines folded to spaces."""
    from bert_mp.data.builtin_corpus import builtin_documents
    from bert_mp.data.segment import split_sentences

    out = []
    for d in builtin_documents():
        sents = [" ".join(s.split()) for s in split_sentences(d["text"])]
        sents = [s for s in sents if len(s.split()) >= 2]
        if sents:
            out.append(sents)
    return out


def _shape_units(shape: str, docs: list[list[str]]):
    """Endless stream of the shape's units: (text, separator after it) in bytes."""
    import itertools

    if shape == "builtin":
        from bert_mp.data.builtin_corpus import builtin_documents

        texts = [d["text"].replace("\n\n", "\n").strip() for d in builtin_documents()]
        for t in itertools.cycle(texts):
            yield t.encode("utf-8") + b"\n\n"
    elif shape == "short":
        words = 0
        doc: list[str] = []
        for s in itertools.cycle(itertools.chain.from_iterable(docs)):
            doc.append(s)
            words += len(s.split())
            if words >= 30:  # ~50 WordPiece tokens of this prose
                yield " ".join(doc).encode("utf-8") + b"\n\n"
                doc, words = [], 0
    elif shape == "line":
        for d in itertools.cycle(docs):
            yield "\n".join(d).encode("utf-8") + b"\n\n"
    elif shape == "long":
        # sentences run on, a line break every few of them, never a blank line
        for i, s in enumerate(itertools.cycle(itertools.chain.from_iterable(docs))):
            yield s.encode("utf-8") + (b"\n" if i % 4 == 3 else b" ")
    elif shape == "one-line":  # sentences run on, never a line break
        for s in itertools.cycle(itertools.chain.from_iterable(docs)):
            yield s.encode("utf-8") + b" "
    elif shape == "books":
        # stanzas of four short lines (verse) alternating with prose paragraphs of 1-3 sentences
        sents = itertools.cycle(itertools.chain.from_iterable(docs))
        k = 0
        while True:
            k += 1
            if k % 2:
                words = " ".join(next(sents) for _ in range(2)).split()
                lines = [" ".join(words[i : i + 7]) for i in range(0, min(len(words), 28), 7)]
                yield "\n".join(lines).encode("utf-8") + b"\n\n"
            else:
                yield " ".join(next(sents) for _ in range(1 + k % 3)).encode("utf-8") + b"\n\n"
    else:
        raise SystemExit(f"unknown shape {shape!r} (one of {', '.join(SHAPES)})")


def write_corpus(folder: Path, size: int, shape: str = "builtin") -> list[Path]:
    """The corpus of ``shape``, ~``size`` bytes, as text files (cached by a marker file)."""
    shape = _shape_source(shape)
    marker = folder / f"COMPLETE-{shape}-{size}"
    if marker.exists():
        return sorted(folder.glob("part-*.txt"))
    folder.mkdir(parents=True, exist_ok=True)
    for old in [*folder.glob("part-*.txt"), *folder.glob("COMPLETE-*")]:
        old.unlink()
    per_file = {"books": BOOK_BYTES, "long": LONG_BYTES, "one-line": size}.get(shape, FILE_BYTES)
    docs = _builtin_sentences() if shape != "builtin" else []
    written, part, buf, buf_bytes = 0, 0, [], 0
    for unit in _shape_units(shape, docs):
        buf.append(unit)
        buf_bytes += len(unit)
        written += len(unit)
        if buf_bytes >= per_file or written >= size:
            (folder / f"part-{part:05d}.txt").write_bytes(b"".join(buf).rstrip(b" ") + b"\n")
            part, buf, buf_bytes = part + 1, [], 0
            if written >= size:
                break
    marker.write_text("")
    return sorted(folder.glob("part-*.txt"))


def ensure_tokenizer(path: Path, vocab_size: int) -> Path:
    from bert_mp.data.builtin_corpus import builtin_documents
    from bert_mp.data.tokenizer import save_tokenizer, train_wordpiece

    if not (path / "tokenizer.json").exists():
        tok = train_wordpiece((d["text"] for d in builtin_documents()), vocab_size)
        save_tokenizer(tok, path)
    return path


def _peak_rss() -> dict:
    return {
        "self_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "largest_child_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
    }


class MemorySampler:
    """Peak memory of this process tree (itself and every descendant), sampled from
    ``/proc/<pid>/status`` every ``interval`` seconds while in a ``with`` block.

    ``RssAnon`` is memory the pipeline holds (heap, Python objects, Arrow buffers it built);
    ``RssFile`` is file pages mapped into the processes (the memory-mapped Arrow caches that
    ``datasets`` reads): page cache the kernel reclaims under pressure, counted by ``ru_maxrss`` but
    not a cost that grows the process. The bound that matters is the anonymous one.
    """

    def __init__(self, interval: float = 0.2):
        import threading

        self.interval = interval
        self.peak = {
            "anon_total": 0,
            "anon_largest_process": 0,
            "file_total": 0,
            "rss_total": 0,
            "processes": 0,
        }
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _status(pid: int) -> dict[str, int]:
        out = {}
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                        k, v = line.split(":", 1)
                        out[k] = int(v.split()[0]) * 1024
        except OSError:  # the process ended between listing and reading
            pass
        return out

    def sample(self) -> None:
        import psutil

        me = psutil.Process()
        pids = [me.pid] + [c.pid for c in me.children(recursive=True)]
        st = [self._status(pid) for pid in pids]
        anon = [x.get("RssAnon", 0) for x in st]
        file = sum(x.get("RssFile", 0) + x.get("RssShmem", 0) for x in st)
        pk = self.peak
        pk["anon_total"] = max(pk["anon_total"], sum(anon))
        pk["anon_largest_process"] = max(pk["anon_largest_process"], max(anon))
        pk["file_total"] = max(pk["file_total"], file)
        pk["rss_total"] = max(pk["rss_total"], sum(anon) + file)
        pk["processes"] = max(pk["processes"], len(pids))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> MemorySampler:
        if os.path.exists("/proc/self/status"):
            self.sample()
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def _cpu_seconds() -> float:
    """CPU seconds of this process and its reaped children (user + system)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def child_tokenize(
    files: list[str], tokenizer: str, num_proc: int, whole_file: bool = False, same_malloc: bool = False
) -> dict:
    """Tokenize-only, timed the way prepare is: from an interpreter with the libraries imported and
    the tokenizer loaded (untimed), to all tokens counted. With ``num_proc`` > 1 the fork of the
    worker pool is on the clock, as prepare's is; ``seconds_pool_untimed`` leaves it out.
    ``same_malloc``: under the glibc malloc settings prepare runs with (``bert_mp.data.allocator``)."""
    from functools import partial
    from multiprocessing import get_context

    from bert_mp.data import allocator

    _init_worker(tokenizer)  # loaded once here; forked workers inherit it
    encode = partial(_encode_file, whole_file=whole_file)
    # memory is sampled on both sides (the sampler's ~2.5 ms every 0.2 s is then no difference)
    tuning = allocator.tuned() if same_malloc else contextlib.nullcontext(False)
    with MemorySampler() as mem, tuning as applied:
        t0 = time.perf_counter()
        if num_proc == 1:
            t1 = t0
            per_file = [encode(f) for f in files]
        else:
            with get_context("fork").Pool(num_proc) as pool:
                t1 = time.perf_counter()
                per_file = list(pool.imap_unordered(encode, files))
        t2 = time.perf_counter()
    wall = t2 - t0
    tokens, cpu = sum(t for t, _ in per_file), sum(c for _, c in per_file)
    return {
        "tokens": tokens,
        "seconds": wall,
        "seconds_pool_untimed": t2 - t1,
        "cpu_seconds": cpu,
        "tokens_per_sec": tokens / wall,
        "tokens_per_cpu_sec": tokens / cpu,
        "malloc_tuned": applied,
        "peak_rss": _peak_rss(),
        "memory_peaks_bytes": mem.peak,
    }


def child_prepare(files: list[str], tokenizer: str, num_proc: int, cache_dir: str, extra: list[str]) -> dict:
    # Library imports are not the pipeline's work: not timed. AutoTokenizer pulls in torch (1-2 s),
    # which is most of what loading a tokenizer costs in a fresh process; tokenize-only loads its
    # tokenizer untimed, so prepare is still charged for more.
    import datasets  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoTokenizer  # noqa: F401

    from bert_mp.core.config import load_config
    from bert_mp.data.prepare import prepare

    cfg = load_config(
        None,
        [
            "data.source=text",
            f"data.paths=[{','.join(files)}]",
            f"data.tokenizer={tokenizer}",
            f"data.num_proc={num_proc}",
            f"data.cache_dir={cache_dir}",
            *extra,
        ],
    )
    c0, t0 = _cpu_seconds(), time.perf_counter()
    with MemorySampler() as mem:
        path = prepare(cfg, force=True)
    wall, cpu = time.perf_counter() - t0, _cpu_seconds() - c0  # map workers are reaped by now
    stats = json.loads((path / "stats.json").read_text())
    train = stats["per_split"]["train"]
    return {
        "tokens": stats["tokens"],
        "mean_example_length": train["mean_length"],
        "padding_fraction_at_max_seq_length": train["padding_fraction_at_max_seq_length"],
        "length_histogram": train["length_histogram"],
        "documents": train["documents"],
        "seconds": wall,
        "cpu_seconds": cpu,
        "tokens_per_sec": stats["tokens"] / wall,
        "tokens_per_cpu_sec": stats["tokens"] / cpu,
        "examples": stats["splits"],
        "stage_seconds": stats["seconds"],
        "block_cpu_seconds": stats["per_split"]["train"]["cpu_seconds"],
        "peak_rss": _peak_rss(),
        "memory_peaks_bytes": mem.peak,
    }


def run_child(
    kind: str, args: argparse.Namespace, files: list[Path], tokenizer: Path, num_proc: int, extra: list[str]
) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        kind,
        "--child-num-proc",
        str(num_proc),
        "--child-files",
        json.dumps([str(f) for f in files]),
        "--child-tokenizer",
        str(tokenizer),
        "--workdir",
        str(args.workdir),
        *(["--extra", *extra] if extra else []),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{kind} (num_proc={num_proc}) failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def one_line_ratios(rows: list[dict]) -> dict[str, float]:
    """The one-line shape's peak anonymous memory (process tree) over each other shape's, per num_proc."""
    anon = {(r["shape"], r["num_proc"]): r["prepare"]["memory_peaks_bytes"]["anon_total"] for r in rows}
    return {
        f"one-line / {shape}, num_proc={n}": anon["one-line", n] / peak
        for (shape, n), peak in anon.items()
        if shape != "one-line" and ("one-line", n) in anon
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="50MB", help="corpus size per shape, e.g. 13MB, 50MB or 5GB")
    p.add_argument(
        "--shapes",
        nargs="+",
        default=["builtin"],
        choices=list(SHAPES),
        help="corpus shapes to measure, each generated locally: "
        + "; ".join(f"{k}: {v[0]}" for k, v in SHAPES.items()),
    )
    p.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--workdir", type=Path, default=Path("runs/bench/prepare_work"))
    p.add_argument("--out", type=Path, default=Path("runs/bench/prepare.json"))
    p.add_argument("--repeat", type=int, default=3, help="measured pairs per num_proc (median reported)")
    p.add_argument(
        "--prepare-only",
        action="store_true",
        help="skip tokenize-only (memory-scaling runs: peak memory only)",
    )
    p.add_argument("--extra", nargs="*", default=[], help="extra data.* overrides for prepare")
    p.add_argument(
        "--no-same-malloc-baseline",
        action="store_true",
        help="skip the second tokenize-only run under prepare's malloc settings (ratio_same_malloc)",
    )
    p.add_argument("--child", choices=list(KINDS), help=argparse.SUPPRESS)
    p.add_argument("--child-num-proc", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-files", help=argparse.SUPPRESS)
    p.add_argument("--child-tokenizer", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.child:
        files = json.loads(args.child_files)
        if args.child != "prepare":
            whole_file = "data.documents=file" in args.extra
            same = args.child == "tokenize-same-malloc"
            res = child_tokenize(files, args.child_tokenizer, args.child_num_proc, whole_file, same)
        else:
            cache = str(args.workdir / "cache")
            res = child_prepare(files, args.child_tokenizer, args.child_num_proc, cache, args.extra)
        print(json.dumps(res))
        return

    size = parse_size(args.size)
    tokenizer = ensure_tokenizer(args.workdir / "tokenizer", args.vocab_size)
    corpora = {}
    for shape in args.shapes:
        source = _shape_source(shape)
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
                got = {kind: run_child(kind, args, files, tokenizer, n, extra) for kind in order}
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
    import datasets
    import tokenizers
    import transformers

    result = {
        "command": "python scripts/bench/prepare.py " + " ".join(sys.argv[1:]),
        "size_per_shape_bytes": size,
        "extra_overrides": args.extra,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "load_average_at_end": os.getloadavg(),
            "python": platform.python_version(),
            "tokenizers": tokenizers.__version__,
            "datasets": datasets.__version__,
            "transformers": transformers.__version__,
        },
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "results": rows,
        "anon_peak_ratios": one_line_ratios(rows),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
