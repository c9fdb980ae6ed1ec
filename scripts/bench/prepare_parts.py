"""The parts of scripts/bench/prepare.py: the corpora it measures on (shapes written from the built-in
corpus; generated text is bench/generated_text.py), the memory sampler, tokenize-only (prepare's
baseline: the same documents batch-encoded by the same tokenizer, in this process or in workers forked
from it) and the two measured children, each run in a fresh process."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import time
from pathlib import Path

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


_ENCODER = None
_ASCII_ENCODER = None


def init_worker(tokenizer_path: str, plain_ascii_fast: bool = False) -> None:
    """The tokenizer of this process; ``plain_ascii_fast``: also prepare's faster copy for plain-ASCII
    documents (``bert_mp.data.tokenizer.plain_ascii_encoder``), where the tokenizer has one."""
    global _ENCODER, _ASCII_ENCODER
    from transformers import AutoTokenizer

    from bert_mp.data.tokenizer import encoder, plain_ascii_encoder

    _ENCODER = encoder(AutoTokenizer.from_pretrained(tokenizer_path))
    _ASCII_ENCODER = plain_ascii_encoder(_ENCODER) if plain_ascii_fast else None


def encode_file(path: str, whole_file: bool = False) -> tuple[int, float]:
    """Tokens of one file and the CPU seconds it took (this worker's process time).

    The file's documents as prepare reads them: the text between blank lines, or (``whole_file``,
    data.documents=file) the whole file as one input; the plain-ASCII ones by the faster encoder
    where :func:`init_worker` made one, as prepare encodes them.
    """
    from bert_mp.data.whitespace import BLANK_LINES_RE

    c0 = time.process_time()
    text = Path(path).read_text(encoding="utf-8")
    docs = [text] if whole_file else [d for d in BLANK_LINES_RE.split(text) if d.strip()]
    groups = [(_ENCODER, docs)]
    if _ASCII_ENCODER is not None:
        import pyarrow as pa

        from bert_mp.data.arrow_text import plain_ascii

        plain = plain_ascii(pa.array(docs, pa.string())).tolist()
        groups = [
            (_ASCII_ENCODER, [d for d, p in zip(docs, plain, strict=True) if p]),
            (_ENCODER, [d for d, p in zip(docs, plain, strict=True) if not p]),
        ]
    tokens = 0
    for enc, part in groups:
        for lo in range(0, len(part), 256):
            encodings = enc.encode_batch_fast(part[lo : lo + 256], add_special_tokens=False)
            tokens += sum(len(e.ids) for e in encodings)
    return tokens, time.process_time() - c0


def _cpu_seconds() -> float:
    """CPU seconds of this process and its reaped children (user + system)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def child_tokenize(
    files: list[str],
    tokenizer: str,
    num_proc: int,
    whole_file: bool = False,
    same_malloc: bool = False,
    plain_ascii_fast: bool = False,
) -> dict:
    """Tokenize-only, timed the way prepare is: from an interpreter with the libraries imported and
    the tokenizer loaded (untimed), to all tokens counted, sampled for the peak memory of the process
    tree. With ``num_proc`` > 1 the fork of the worker pool is on the clock, as prepare's is
    (``seconds_pool_untimed`` leaves it out). ``same_malloc``: under the glibc malloc settings prepare
    runs with (``bert_mp.data.allocator``); ``plain_ascii_fast``: plain-ASCII documents by prepare's
    faster encoder, as prepare does."""
    from functools import partial
    from multiprocessing import get_context

    from bert_mp.data import allocator

    init_worker(tokenizer, plain_ascii_fast)  # loaded once here, untimed; forked workers inherit it
    encode = partial(encode_file, whole_file=whole_file)
    # memory is sampled on both sides (the sampler's ~2.5 ms every 0.2 s is then no difference)
    tuning = allocator.tuned() if same_malloc else contextlib.nullcontext(False)
    c0 = _cpu_seconds()
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
    wall, cpu = t2 - t0, _cpu_seconds() - c0  # the pool's workers are reaped by now
    tokens = sum(t for t, _ in per_file)
    return {
        "tokens": tokens,
        "seconds": wall,
        "seconds_pool_untimed": t2 - t1,
        "cpu_seconds": cpu,
        "cpu_seconds_encoding": sum(c for _, c in per_file),
        "tokens_per_sec": tokens / wall,
        "tokens_per_cpu_sec": tokens / cpu,
        "malloc_tuned": applied,
        "plain_ascii_fast": plain_ascii_fast,
        "peak_rss": _peak_rss(),
        "memory_peaks_bytes": mem.peak,
        "load_average_after": os.getloadavg(),
    }


def child_prepare(paths: list[str], cache_dir: str, overrides: list[str]) -> dict:
    """One ``prepare`` of ``paths`` (text) in this fresh process, the libraries imported first, untimed
    (AutoTokenizer pulls in torch, most of what loading a tokenizer costs): wall and CPU seconds of the
    process tree, stats.json's stages, lengths and vocabulary record, peak memory."""
    import datasets  # noqa: F401
    from transformers import AutoTokenizer  # noqa: F401

    from bert_mp.core.config import load_config
    from bert_mp.data.prepare import prepare

    cfg = load_config(
        None,
        ["data.source=text", f"data.paths=[{','.join(paths)}]", f"data.cache_dir={cache_dir}", *overrides],
    )
    c0, t0 = _cpu_seconds(), time.perf_counter()
    with MemorySampler() as mem:
        path = prepare(cfg, force=True)
    wall, cpu = time.perf_counter() - t0, _cpu_seconds() - c0  # map workers are reaped by now
    stats = json.loads((path / "stats.json").read_text())
    train = stats["per_split"]["train"]
    return {
        "folder": str(path),
        "tokens": stats["tokens"],
        "mean_example_length": train["mean_length"],
        "padding_fraction_at_max_seq_length": train["padding_fraction_at_max_seq_length"],
        "length_histogram": train["length_histogram"],
        "documents": train["documents"],
        "documents_kept": stats["documents"]["documents_kept"],
        "seconds": wall,
        "cpu_seconds": cpu,
        "tokens_per_sec": stats["tokens"] / wall,
        "tokens_per_cpu_sec": stats["tokens"] / cpu,
        "examples": stats["splits"],
        "stage_seconds": stats["seconds"],
        "block_cpu_seconds": train["cpu_seconds"],
        "vocabulary": stats["vocabulary"],
        "vocabulary_share_of_wall": stats["seconds"]["tokenizer"] / wall if stats["vocabulary"] else None,
        "peak_rss": _peak_rss(),
        "memory_peaks_bytes": mem.peak,
        "load_average_after": os.getloadavg(),
    }
