"""Reading the corpus into a memory-mapped Arrow ``Dataset``, by up to ``data.num_proc`` reader processes
(each a contiguous run of the file list), with the hashes ``data.dedupe`` needs.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from bert_mp.core.config import DataConfig
from bert_mp.data.corpus import (
    ReadStats,
    describe_source,
    is_file_source,
    iter_documents,
    merge_read_stats,
    resolve_paths,
)
from bert_mp.errors import DataError


@contextlib.contextmanager
def arrow_stream(path: str | Path, schema: pa.Schema) -> Iterator[pa.ipc.RecordBatchStreamWriter]:
    """A writer of the Arrow stream file ``path`` (the format ``Dataset.from_file`` memory-maps)."""
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        yield writer


_READER_BYTES = 32 << 20
"""Bytes of files per reader process (``data.num_proc`` is the most)."""
_READ_BATCH_CHARS = 4 * 1024 * 1024
_TEXT_SCHEMA = pa.schema([("text", pa.string())])
_HASHED_SCHEMA = pa.schema([("text", pa.string()), ("hash_hi", pa.uint64()), ("hash_lo", pa.uint64())])


def _text_hashes(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """128-bit BLAKE2b of each document's stripped text, as two uint64 arrays (for data.dedupe)."""
    raw = b"".join(
        hashlib.blake2b(t.strip().encode("utf-8", "surrogatepass"), digest_size=16).digest() for t in texts
    )
    pairs = np.frombuffer(raw, dtype="<u8").reshape(-1, 2)
    return pairs[:, 0].copy(), pairs[:, 1].copy()


def first_occurrences(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """Sorted indices of the first occurrence of every distinct ``(hi, lo)`` pair."""
    if hi.size == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((np.arange(hi.size), lo, hi))  # by hash, then by position
    h, l_ = hi[order], lo[order]
    new = np.ones(hi.size, dtype=bool)
    new[1:] = (h[1:] != h[:-1]) | (l_[1:] != l_[:-1])
    return np.sort(order[new])


_docs_read: Any = None  # a shared counter of documents read, for the parent's progress bar


class _LocalCounter:
    """``mp.Value``'s interface (``value``, ``get_lock()``) for a counter used in one process."""

    value = 0

    def get_lock(self) -> contextlib.nullcontext:
        return contextlib.nullcontext()


def _init_reader(counter: Any) -> None:
    global _docs_read
    _docs_read = counter


def _read_job(data: DataConfig, paths: list[str] | None, out: str) -> ReadStats:
    """Documents of ``paths`` (``None``: the whole configured source) into the Arrow stream
    ``out``, a record batch per ~4 M characters: Arrow arrays built from lists of strings, with
    no per-document Python encoding step (``Dataset.from_generator`` encodes every example
    through ``Features``, which was half of the reading time)."""
    stats = ReadStats()
    batch: list[str] = []
    size = 0
    schema = _HASHED_SCHEMA if data.dedupe else _TEXT_SCHEMA
    with arrow_stream(out, schema) as writer:

        def flush() -> None:
            cols = [pa.array(batch, pa.string())]
            if data.dedupe:
                cols += [pa.array(h) for h in _text_hashes(batch)]
            writer.write_batch(pa.record_batch(cols, schema=schema))
            if _docs_read is not None:
                with _docs_read.get_lock():
                    _docs_read.value += len(batch)
            batch.clear()

        for text in iter_documents(data, stats, None if paths is None else [Path(p) for p in paths]):
            batch.append(text)
            size += len(text)
            if size >= _READ_BATCH_CHARS:
                flush()
                size = 0
        if batch:
            flush()
    return stats


def _file_groups(paths: list[Path], jobs: int) -> list[list[str]]:
    """The file list cut into at most ``jobs`` contiguous runs of about equal bytes."""
    sizes = np.array([max(1, p.stat().st_size) for p in paths], dtype=np.float64)
    cuts = np.searchsorted(np.cumsum(sizes), sizes.sum() * np.arange(1, jobs) / jobs, side="left") + 1
    bounds = [0, *sorted(set(int(c) for c in cuts if 0 < c < len(paths))), len(paths)]
    return [[str(p) for p in paths[lo:hi]] for lo, hi in itertools.pairwise(bounds)]


def read_documents(data: DataConfig, work: Path) -> tuple[Any, ReadStats]:
    """The corpus as a one-column (``text``) memory-mapped Arrow Dataset; counts in ReadStats.

    Files are read by up to ``num_proc`` processes, each a contiguous run of the file list into
    its own Arrow file, and the files are concatenated in order, so the documents and their
    indices are the same for any ``num_proc``. Memory stays bounded by a record batch per process.
    """
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    from datasets import Dataset, concatenate_datasets
    from tqdm.auto import tqdm

    out_dir = work / "documents"
    out_dir.mkdir(parents=True, exist_ok=True)
    groups: list[list[str] | None] = [None]
    resolved = ReadStats()  # files reached twice, counted while resolving the paths
    if is_file_source(data):
        paths = resolve_paths(data.paths, resolved)
        jobs = 1
        # max_documents counts across all files: one reader then; a reader process pays for itself
        # only on tens of megabytes (one reads ~200 MB/s; starting one takes ~0.1 s)
        if data.num_proc > 1 and data.max_documents is None:
            size = sum(p.stat().st_size for p in paths)
            jobs = min(data.num_proc, len(paths), max(1, size // _READER_BYTES))
        groups = _file_groups(paths, jobs) if jobs > 1 else [[str(p) for p in paths]]
    outs = [str(out_dir / f"part-{i:05d}.arrow") for i in range(len(groups))]
    # a shared counter only where other processes read (a lock-free one otherwise: no import of
    # multiprocessing's synchronisation machinery, a tenth of a second, for one reader)
    counter = mp.Value("q", 0) if len(groups) > 1 else _LocalCounter()
    with tqdm(desc="reading documents", unit=" docs", dynamic_ncols=True) as bar:
        if len(groups) == 1:
            _init_reader(counter)
            try:
                parts = [_read_job(data, groups[0], outs[0])]
            finally:
                _init_reader(None)
            bar.update(counter.value)
        else:
            with ProcessPoolExecutor(len(groups), initializer=_init_reader, initargs=(counter,)) as pool:
                futures = [pool.submit(_read_job, data, g, o) for g, o in zip(groups, outs, strict=True)]
                try:  # the bar follows the shared counter; the wait ends as the last reader does
                    while wait(futures, timeout=0.1).not_done:
                        bar.update(counter.value - bar.n)
                except BaseException:  # an interruption: end the readers now, not when they finish
                    stop_pool(pool)
                    raise
                try:
                    parts = [f.result() for f in futures]  # the first failing run (in file order) raises
                except BrokenProcessPool:
                    raise DataError(
                        f"a reader process ended abruptly (killed, e.g. by the out-of-memory killer) while "
                        f"reading {describe_source(data)} with data.num_proc={data.num_proc}; "
                        "data.num_proc=1 reads in this process"
                    ) from None
            bar.update(counter.value - bar.n)
    stats = merge_read_stats([resolved, *parts])
    if stats.documents_kept == 0:
        detail = f"{stats.documents_read} read, {stats.dropped_empty} empty"
        if stats.binary_files:
            detail += f", {stats.binary_files} binary files skipped (first: {stats.first_binary_file})"
        if stats.records_without_text:
            detail += f", {stats.records_without_text} without a string {data.text_column!r} ({stats.first_problem})"
        raise DataError(f"no usable documents in {describe_source(data)} ({detail})")
    docs = [Dataset.from_file(o) for o in outs]
    return (docs[0] if len(docs) == 1 else concatenate_datasets(docs)), stats


def stop_pool(pool: Any) -> None:
    """Cancel a ProcessPoolExecutor's queued jobs and terminate its workers (Python 3.14 has
    ``terminate_workers``; before, the workers are reached through ``_processes``)."""
    if hasattr(pool, "terminate_workers"):
        pool.terminate_workers()
        return
    workers = list((getattr(pool, "_processes", None) or {}).values())  # shutdown() forgets them
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in workers:
        proc.terminate()


def share_range(n_docs: int, index: int, count: int) -> tuple[int, int]:
    """``[start, end)`` of share ``index`` of ``count`` contiguous shares of ``n_docs`` documents: the
    first ``n_docs % count`` shares one document longer, as ``datasets``' contiguous ``shard`` cuts."""
    size, longer = divmod(n_docs, count)
    start = index * size + min(index, longer)
    return start, start + size + (1 if index < longer else 0)


def take_share(docs: Any, data: DataConfig) -> tuple[Any, dict]:
    """The documents of ``data.shard`` (``Dataset.shard(N, I, contiguous=True)``) and what it holds:
    ``{"index", "count", "documents": [start, end), "corpus_documents"}``, the range in the whole
    corpus's document order, so N shares are seen to tile it."""
    index, count = data.shard_parts()
    n_docs = len(docs)
    start, end = share_range(n_docs, index, count)
    if count > 1:
        docs = docs.shard(num_shards=count, index=index, contiguous=True)
        assert len(docs) == end - start, "datasets cut the shares otherwise"  # internal invariant
    return docs, {"index": index, "count": count, "documents": [start, end], "corpus_documents": n_docs}


def peak_memory() -> dict[str, int]:
    """Peak resident memory of this process and of its largest worker (pairing, reading) so far, in bytes."""
    import resource
    import sys

    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: kilobytes on Linux, bytes on macOS
    return {
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit,
        "workers_peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * unit,
    }
