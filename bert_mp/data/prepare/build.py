"""``bert-mp prepare``: the build of a prepared folder in a temporary folder, renamed into
``<cache_dir>/<cache_key>/`` with a ``PREPARED`` marker written last, interruptions and refused writes
turned into one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc

from bert_mp.core.config import Config, DataConfig, save_config
from bert_mp.core.process import console
from bert_mp.core.storage import checksums, folder_lock
from bert_mp.core.storage import disk as storage
from bert_mp.core.storage.files import atomic_write_json
from bert_mp.data import allocator
from bert_mp.data.corpus import describe_source
from bert_mp.data.fingerprint import FORM as FINGERPRINT_FORM
from bert_mp.data.fingerprint import MANIFEST, data_fingerprint, legacy_fingerprints
from bert_mp.data.prepare.blocks import BlockPairer, assign_splits, make_blocks
from bert_mp.data.prepare.cache import MARKER, cache_path, is_complete
from bert_mp.data.prepare.interrupts import interrupts_in_this_process_only
from bert_mp.data.prepare.pool import pair_blocks
from bert_mp.data.prepare.read import first_occurrences, peak_memory, read_documents, take_share
from bert_mp.data.prepare.stats import collect_stats, print_summary, stats_warnings
from bert_mp.data.prepare.vocab import remove_own_tokenizer_tmp, tokenizer_for
from bert_mp.data.tokenizer import save_tokenizer
from bert_mp.errors import DataError, Interrupted


def split_documents(table: Any, data: DataConfig) -> tuple[dict[int, np.ndarray], int]:
    """The training (0) and validation (1) documents of ``table``, ascending: by a hash of (seed,
    index), without the exact duplicates that ``data.dedupe`` drops; and how many it dropped."""
    n_docs = table.num_rows
    val_mask = assign_splits(n_docs, data.validation_fraction, data.seed)
    kept = np.ones(n_docs, dtype=bool)
    if data.dedupe:
        hi, lo = (table.column(c).to_numpy() for c in ("hash_hi", "hash_lo"))
        kept[:] = False
        kept[first_occurrences(hi, lo)] = True
        kept_ids = np.flatnonzero(kept)
        if (
            kept_ids.size >= 2
            and data.validation_fraction > 0
            and (val_mask[kept_ids].all() or not val_mask[kept_ids].any())
        ):
            # the duplicates took all of one split: split the kept documents among themselves
            val_mask[kept_ids] = assign_splits(kept_ids.size, data.validation_fraction, data.seed)
    split = {0: np.flatnonzero(~val_mask & kept), 1: np.flatnonzero(val_mask & kept)}
    return split, int(n_docs - kept.sum())


def _build(cfg: Config, out: Path, force: bool = False) -> dict:
    """Build the whole prepared folder at ``out``; returns the stats."""
    from datasets import DatasetDict

    data = cfg.data
    work = out / "work"
    work.mkdir(parents=True)
    timings: dict[str, float] = {}
    t_start = time.perf_counter()

    t = time.perf_counter()
    docs, read_stats = read_documents(data, work)
    corpus = docs.data.table
    corpus_chars = pc.utf8_length(corpus.column("text")).to_numpy(zero_copy_only=False).astype(np.int64)
    docs, share = take_share(docs, data)  # data.shard=I/N: this machine's contiguous share
    timings["read"] = time.perf_counter() - t

    chars = corpus_chars[slice(*share["documents"])]
    split_docs, read_stats.duplicate_documents = split_documents(docs.data.table, data)
    blocks = {s: make_blocks(ids, chars[ids], data.pairing_block_chars) for s, ids in split_docs.items()}

    t = time.perf_counter()
    # a vocabulary is learned from the whole corpus's training documents (those of data.shard=0/1),
    # so every share learns the same one
    vocab_ids = None
    if not data.tokenizer:
        vocab_ids = split_docs[0] if share["count"] == 1 else split_documents(corpus, data)[0][0]
    tokenizer, tokenizer_from, vocabulary = tokenizer_for(data, corpus, vocab_ids, corpus_chars, force)
    timings["tokenizer"] = time.perf_counter() - t

    t = time.perf_counter()
    pairer = BlockPairer(docs, tokenizer, data)
    splits, block_stats = pair_blocks(pairer, blocks, chars, data, work)
    timings["split_tokenize_pair"] = time.perf_counter() - t

    if len(splits["train"]) == 0 and data.objective == "mlm":
        raise DataError(
            f"{describe_source(data)} gave no training examples: no training document has a token"
        )
    if len(splits["train"]) == 0:
        raise DataError(
            f"{describe_source(data)} gave no training pairs: every document is a single sentence and there is no "
            "other document for a random B; add documents or use a multi-sentence corpus"
        )

    t = time.perf_counter()
    dd = DatasetDict(splits)
    num_shards = {name: max(1, min(data.num_shards, len(ds))) for name, ds in dd.items()}
    dd.save_to_disk(str(out / "dataset"), num_shards=num_shards)
    save_tokenizer(tokenizer, out / "tokenizer")
    timings["write"] = time.perf_counter() - t

    stats = collect_stats(
        data, dd, tokenizer, tokenizer_from, read_stats, block_stats, timings, time.perf_counter() - t_start
    )
    stats["vocabulary"] = vocabulary
    stats["shard"] = share
    stats["memory"] = peak_memory()
    shutil.rmtree(work, ignore_errors=True)
    return stats


def no_bar_monitor_thread() -> None:
    """No tqdm monitor thread in this process: prepare forks its reader and pairing workers while its
    progress bars are open, and a fork taken while that thread holds a lock (tqdm's, or the stream's
    it writes a bar to) leaves the lock held in the child for ever. The monitor only splits a bar's
    refreshes when a huge ``miniters`` stalls it; prepare's bars refresh by time."""
    from tqdm import tqdm

    tqdm.monitor_interval = 0


def prepare(cfg: Config, force: bool = False) -> Path:
    """The prepared folder for ``cfg.data``, built unless a complete cached copy exists (or ``force``).

    One process builds a folder at a time (:func:`builder`): a second one of the same key waits for
    the first, then reuses what it built (even with ``force``: that build is as fresh)."""
    data = cfg.data
    data.validate()
    final = cache_path(data)
    if is_complete(final) and not force:
        console.say(f"reusing {final} (same data config; --force rebuilds)", command="prepare")
        return final
    with builder(final, data.build_wait_s) as waited_for:
        if is_complete(final) and (waited_for or not force):
            console.say(f"reusing {final}, built meanwhile by {waited_for or 'another process'}")
            return final
        stats = _build_folder(cfg, final, force)
    print_summary(stats, final)
    return final


@contextlib.contextmanager
def builder(final: Path, wait_s: float | None) -> Iterator[str | None]:
    """Hold the lock of ``final``'s builder (:mod:`bert_mp.core.storage.folder_lock`: an ``flock`` of
    ``<cache_dir>/.building-<key>/bert-mp.lock``, which the kernel drops when this process ends,
    however it ends). Where another process holds it, say once whom this one waits for, and wait
    (at most ``wait_s`` seconds: then one line, exit 2). Yields the holder waited for (None where
    none), and, holding the lock, removes the temporary folders of builders that died."""
    lock_dir = final.parent / f".building-{final.name}"
    waited: list[folder_lock.Holder | None] = []

    def on_wait(holder: folder_lock.Holder | None) -> None:
        waited.append(holder)
        who = holder.describe() if holder else "a process whose lock file names no holder"
        console.say(f"waiting for {who} to finish building {final}")

    try:
        final.parent.mkdir(parents=True, exist_ok=True)  # the cache folder stays when the lock goes
        lock = folder_lock.take_waiting(lock_dir, folder_lock.me(), wait_s, on_wait)
    except OSError as e:  # a full or read-only disk: nothing built, nothing left
        if storage.write_failure(e) is None:
            raise DataError(
                f"data.cache_dir={final.parent}: cannot hold {lock_dir} ({storage.reason(e)})"
            ) from None
        raise storage.storage_error(
            "the prepared data",
            final.parent,
            e,
            None,
            f"nothing written to {final}. Free disk space (or set data.cache_dir to a larger disk) and run "
            "bert-mp prepare again",
        ) from None
    except folder_lock.FolderInUse as e:
        who = e.holder.describe() if e.holder else "another process"
        raise DataError(
            f"{final} is still being built by {who} after data.build_wait_s={wait_s:g} s; wait for it "
            f"(a larger data.build_wait_s, or none) or stop it (kill -TERM {e.holder.pid if e.holder else 'PID'})"
        ) from None
    if lock.problem:
        console.say(
            f"warning: {final.parent}: this file system cannot lock files ({lock.problem}); a second "
            "prepare of the same data at the same time would build it again beside this one"
        )
    try:
        with lock:
            for pattern in (f".tmp-{final.name}-*", f".old-{final.name}-*") if lock.fd is not None else ():
                for stale in final.parent.glob(pattern):  # a builder's that died (SIGKILL)
                    shutil.rmtree(stale, ignore_errors=True)
            yield _who(waited[0]) if waited else None
    finally:
        with contextlib.suppress(OSError):  # left by a builder that died (a waiter's take makes it again)
            lock_dir.rmdir()


def _who(holder: folder_lock.Holder | None) -> str:
    return f"pid {holder.pid} on {holder.host}" if holder else "another process"


def _build_folder(cfg: Config, final: Path, force: bool) -> dict:
    """Build ``final`` in a temporary folder and rename it into place; the stats."""
    data = cfg.data
    final.parent.mkdir(parents=True, exist_ok=True)
    no_bar_monitor_thread()
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    was_complete = is_complete(final)

    def on_exit(signum: int) -> None:  # SIGTERM (or a second Ctrl-C): the process exits right after
        detail = _left_behind(final, tmp, was_complete)
        shutil.rmtree(tmp, ignore_errors=True)
        remove_own_tokenizer_tmp(data)
        if console.is_main_process():  # named for the command run (train, when it prepares first)
            print(Interrupted(signum, detail).line(console.command("prepare")), file=sys.stderr)

    try:
        with interrupts_in_this_process_only(on_exit) as caught:
            try:
                tmp.mkdir()
                with allocator.tuned():
                    stats = _build(cfg, tmp, force)
                stats["warnings"] = stats_warnings(stats, data)
                _record(cfg, tmp, final, stats)
                (tmp / MARKER).write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()) + "\n")
                storage.replace_folder(tmp, final)
                checksums.remember(final, MANIFEST)  # hashed just now: a train in this process reads it once
            except BaseException as e:
                if caught.signum is None:
                    refused = _refused_write(e, final, tmp, was_complete)
                    if refused is None:
                        raise
                    raise refused from None
                # whatever unwinding the worker pools raised on the way (datasets chains a TimeoutError)
                raise Interrupted(caught.signum, _left_behind(final, tmp, was_complete)) from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return stats


def _record(cfg: Config, tmp: Path, final: Path, stats: dict) -> None:
    """The data's fingerprint into ``stats``, then ``config.yaml``, ``stats.json`` and the manifest of
    every file (each file read once: the fingerprint is of the manifest's digests of the data files)."""
    entries = checksums.manifest_entries(tmp, MANIFEST)
    stats["fingerprint"] = data_fingerprint(tmp, entries)
    stats["fingerprint_hash"] = FINGERPRINT_FORM
    _say_if_rebuilt_differently(final, stats["fingerprint"])
    save_config(data_only(cfg), tmp / "config.yaml")
    atomic_write_json(tmp / "stats.json", stats)
    checksums.write_manifest(tmp, MANIFEST, known=entries)


def _refused_write(e: BaseException, final: Path, tmp: Path, was_complete: bool) -> BaseException | None:
    """A build the disk refused (full, read-only, I/O error) as one line, else None (re-raise ``e``)."""
    if not isinstance(e, Exception) or storage.write_failure(e) is None:
        return None
    written, left = storage.human_bytes(storage.folder_bytes(tmp)), _left_behind(final, tmp, was_complete)
    storage.remove_quietly(tmp)  # before the free space is measured: it only held space
    return storage.storage_error(
        "the prepared data",
        final.parent,
        e,
        None,
        f"the build had written {written} when it stopped (it needs more); {left}. Free disk space "
        "(or set data.cache_dir to a larger disk) and run bert-mp prepare again",
    )


def _left_behind(final: Path, tmp: Path, was_complete: bool) -> str:
    """What an interrupted :func:`prepare` leaves at ``final`` (its temporary folder is removed)."""
    if not is_complete(final):
        if was_complete:  # the signal came between the two renames of replace_folder
            return f"{final} removed while its older copy was being replaced; run prepare again"
        return f"nothing written to {final}"
    return f"{final} kept as it was" if tmp.exists() else f"{final} was complete before the signal"


def _say_if_rebuilt_differently(final: Path, fingerprint: str) -> None:
    """``--force`` over a folder whose data changes (``fingerprint``: the new build's): runs trained on
    it must hear of it. An old folder of an earlier form is fingerprinted in this one to compare."""
    old_stats = final / "stats.json"
    if not old_stats.is_file():
        return
    recorded = json.loads(old_stats.read_text(encoding="utf-8"))
    old = recorded.get("fingerprint")
    if recorded.get("fingerprint_hash") != FINGERPRINT_FORM and old:
        old = legacy_fingerprints(final)[FINGERPRINT_FORM]
    if old and old != fingerprint:
        console.say(
            f"warning: rebuilt {final} with other data (fingerprint {old} -> {fingerprint}); "
            "runs trained on the old data refuse to resume on it unless train.allow_data_change=true",
            command="prepare",
        )


def data_only(cfg: Config) -> Config:
    """The config with only the data section from ``cfg`` (the rest at defaults): what the folder depends on."""
    return Config(data=cfg.data)


def command(cfg: Config, force: bool = False) -> int:
    """``bert-mp prepare [CONFIG] [key=value ...] [--force]`` for the config the CLI loaded."""
    prepare(cfg, force=force)
    return 0
