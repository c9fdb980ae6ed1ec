"""Benchmark `bert-mp prepare` against batch-encoding alone, on the same files and cores.

Writes the built-in corpus out as text files (documents separated by blank lines), repeated up to
``--size``; trains (or reuses) a WordPiece tokenizer once, untimed; then for each ``--num-proc``
times, each in a fresh subprocess (so peak RSS is per measurement):

  (a) prepare: read, split sentences, tokenize, pair, mask (static only), write - the real
      ``bert_mp.data.prepare.prepare`` with ``data.tokenizer`` pointing at the trained tokenizer;
  (b) tokenize-only: read the same files, split them into the same documents, and
      ``encode_batch_fast`` them with the same Rust tokenizer in N processes.

Both count tokens of the text (no [CLS]/[SEP]) and run with TOKENIZERS_PARALLELISM=false, so N
processes use N cores in both. The ratio is given per wall second and per CPU second (user +
system of all processes): on a shared, loaded machine the CPU ratio is the steadier of the two.
The pair (a, b) is measured ``--repeat`` times, back to back and in alternating order, and the
median of the per-pair ratios is reported: a slow or fast phase of a shared machine then hits
both sides of a pair, not one side of the whole comparison. Prints a table and writes JSON
(``--out``, with every trial).

    python scripts/bench_prepare.py --size 50MB --num-proc 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from multiprocessing import Pool
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per process on both sides

FILE_BYTES = 2_000_000


def parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    t = text.strip().upper()
    for u, m in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * m)
    return int(t)


def write_corpus(folder: Path, size: int) -> list[Path]:
    """The built-in corpus, paragraph breaks folded into line breaks, repeated into ~2 MB files."""
    from bert_mp.data.builtin_corpus import builtin_documents

    marker = folder / f"COMPLETE-{size}"
    if marker.exists():
        return sorted(folder.glob("part-*.txt"))
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("part-*.txt"):
        old.unlink()
    docs = [d["text"].replace("\n\n", "\n").strip().encode("utf-8") + b"\n\n" for d in builtin_documents()]
    written, part, buf = 0, 0, []
    i = 0
    while written < size:
        doc = docs[i % len(docs)]
        buf.append(doc)
        written += len(doc)
        i += 1
        if sum(map(len, buf)) >= FILE_BYTES or written >= size:
            (folder / f"part-{part:05d}.txt").write_bytes(b"".join(buf))
            part, buf = part + 1, []
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


_ENCODER = None


def _init_worker(tokenizer_path: str) -> None:
    global _ENCODER
    from transformers import AutoTokenizer

    from bert_mp.data.tokenizer import encoder

    _ENCODER = encoder(AutoTokenizer.from_pretrained(tokenizer_path))


def _encode_file(path: str) -> tuple[int, float]:
    """Tokens of one file and the CPU seconds it took (this worker's process time)."""
    from bert_mp.data.corpus import _BLANK_LINE

    c0 = time.process_time()
    text = Path(path).read_text(encoding="utf-8")
    docs = [d for d in _BLANK_LINE.split(text) if d.strip()]
    tokens = 0
    for lo in range(0, len(docs), 256):
        encodings = _ENCODER.encode_batch_fast(docs[lo : lo + 256], add_special_tokens=False)
        tokens += sum(len(e.ids) for e in encodings)
    return tokens, time.process_time() - c0


def _cpu_seconds() -> float:
    """CPU seconds of this process and its reaped children (user + system)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _ready(_: int) -> bool:
    return _ENCODER is not None


def child_tokenize(files: list[str], tokenizer: str, num_proc: int) -> dict:
    with Pool(num_proc, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        assert all(pool.map(_ready, range(num_proc * 4), chunksize=1))  # workers started: not timed
        t0 = time.perf_counter()
        per_file = list(pool.imap_unordered(_encode_file, files))
        wall = time.perf_counter() - t0
    tokens, cpu = sum(t for t, _ in per_file), sum(c for _, c in per_file)
    return {
        "tokens": tokens,
        "seconds": wall,
        "cpu_seconds": cpu,
        "tokens_per_sec": tokens / wall,
        "tokens_per_cpu_sec": tokens / cpu,
        "peak_rss": _peak_rss(),
    }


def child_prepare(files: list[str], tokenizer: str, num_proc: int, cache_dir: str, extra: list[str]) -> dict:
    # Library imports are not the pipeline's work: not timed. AutoTokenizer pulls in torch (1-2 s),
    # which is most of what loading a tokenizer costs in a fresh process; tokenize-only loads its
    # tokenizer in the workers' initializer, untimed, so prepare is still charged for more.
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
    return {
        "tokens": stats["tokens"],
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


def run_child(kind: str, args: argparse.Namespace, files: list[Path], tokenizer: Path, num_proc: int) -> dict:
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
        *(["--extra", *args.extra] if args.extra else []),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{kind} (num_proc={num_proc}) failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="50MB", help="corpus size, e.g. 50MB or 5GB")
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
    p.add_argument("--child", choices=["prepare", "tokenize"], help=argparse.SUPPRESS)
    p.add_argument("--child-num-proc", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-files", help=argparse.SUPPRESS)
    p.add_argument("--child-tokenizer", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.child:
        files = json.loads(args.child_files)
        if args.child == "tokenize":
            res = child_tokenize(files, args.child_tokenizer, args.child_num_proc)
        else:
            cache = str(args.workdir / "cache")
            res = child_prepare(files, args.child_tokenizer, args.child_num_proc, cache, args.extra)
        print(json.dumps(res))
        return

    size = parse_size(args.size)
    files = write_corpus(args.workdir / "corpus", size)
    corpus_bytes = sum(f.stat().st_size for f in files)
    tokenizer = ensure_tokenizer(args.workdir / "tokenizer", args.vocab_size)
    print(f"corpus: {len(files)} files, {corpus_bytes / 1e6:.1f} MB; tokenizer: {tokenizer}", flush=True)

    rows = []
    for n in args.num_proc:
        trials = []
        for r in range(args.repeat):
            order = ("tokenize", "prepare") if r % 2 == 0 else ("prepare", "tokenize")
            if args.prepare_only:
                order = ("prepare",)
            got = {kind: run_child(kind, args, files, tokenizer, n) for kind in order}
            prep = got["prepare"]
            tok = got.get("tokenize") or {"tokens_per_sec": float("nan"), "tokens_per_cpu_sec": float("nan")}
            trial = {
                "order": list(order),
                "tokenize_only": tok,
                "prepare": prep,
                "ratio": prep["tokens_per_sec"] / tok["tokens_per_sec"],
                "cpu_ratio": prep["tokens_per_cpu_sec"] / tok["tokens_per_cpu_sec"],
            }
            trials.append(trial)
            print(
                f"num_proc={n} trial {r + 1}/{args.repeat}: tokenize-only {tok['tokens_per_sec']:,.0f} tok/s, "
                f"prepare {prep['tokens_per_sec']:,.0f} tok/s, ratio {trial['ratio']:.2f} "
                f"(per CPU second: {trial['cpu_ratio']:.2f})",
                flush=True,
            )
        ratios = sorted(t["ratio"] for t in trials)
        median = statistics.median(ratios)
        mid = min(trials, key=lambda t: abs(t["ratio"] - median))  # the trial shown in the table
        rows.append(
            {
                "num_proc": n,
                "ratio": median,
                "cpu_ratio": statistics.median(t["cpu_ratio"] for t in trials),
                "ratio_min_max": [ratios[0], ratios[-1]],
                "tokenize_only": mid["tokenize_only"],
                "prepare": mid["prepare"],
                "trials": trials,
            }
        )

    print()
    head = (
        "num_proc",
        "tokenize tok/s",
        "prepare tok/s",
        "median ratio",
        "min-max",
        "cpu ratio",
        "prep s",
        "peak RSS MB",
        "anon peak MB",
    )
    print("  ".join(f"{h:>14}" for h in head))
    for r in rows:
        cells = (
            r["num_proc"],
            f"{r['tokenize_only']['tokens_per_sec']:,.0f}",
            f"{r['prepare']['tokens_per_sec']:,.0f}",
            f"{r['ratio']:.2f}",
            "{:.2f}-{:.2f}".format(*r["ratio_min_max"]),
            f"{r['cpu_ratio']:.2f}",
            f"{r['prepare']['seconds']:.1f}",
            f"{max(r['prepare']['peak_rss'].values()) / 1e6:.0f}",
            f"{r['prepare']['memory_peaks_bytes']['anon_total'] / 1e6:.0f}",
        )
        print("  ".join(f"{c:>14}" for c in cells))
    import datasets
    import tokenizers
    import transformers

    result = {
        "corpus_bytes": corpus_bytes,
        "files": len(files),
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
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
