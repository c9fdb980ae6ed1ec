"""The pairing pool: every block of both splits through :class:`~bert_mp.data.prepare.blocks.BlockPairer`,
in this process or in ``data.num_proc`` worker processes (longest job first), joined in (split, block)
order so the rows are the same for any ``num_proc``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from bert_mp.core.config import DataConfig
from bert_mp.core.process.hold import hold
from bert_mp.data.prepare.blocks import BlockPairer, Tokens
from bert_mp.data.prepare.cache import SPLITS
from bert_mp.data.prepare.read import arrow_stream, stop_pool
from bert_mp.errors import DataError

_PAIR_WORKER: tuple | None = None
"""``(pairer, blocks, out_dir)`` in a pairing worker process (:func:`_init_pair_worker`)."""


def _init_pair_worker(pairer: BlockPairer, blocks: dict, out_dir: Path) -> None:
    global _PAIR_WORKER
    _PAIR_WORKER = (pairer, blocks, out_dir)


def _block_file(out_dir: Path, split: int, block: int) -> Path:
    return out_dir / f"{split}_{block:08d}.arrow"


def _pair_job(split: int, block: int, parts: list[tuple[Tokens, dict]] | None = None) -> dict:
    """One block in a worker: its examples to ``<out_dir>/<split>_<block>.arrow``; its statistics
    back. ``parts``: the block's tokens, encoded in pieces by :func:`_tokens_job`."""
    assert _PAIR_WORKER is not None, "a pairing job outside a pairing worker"
    pairer, blocks, out_dir = _PAIR_WORKER
    table, st = pairer(split, block, blocks[split][block], parts)
    path = _block_file(out_dir, split, block)
    with arrow_stream(path, pairer.schema) as writer:
        writer.write_table(table)
    return st


def _tokens_job(split: int, block: int, doc_ids: np.ndarray) -> tuple[Tokens, dict]:
    """A run of a block's documents encoded in a worker: :meth:`BlockPairer.tokens`, sent back."""
    assert _PAIR_WORKER is not None, "a tokens job outside a pairing worker"
    return _PAIR_WORKER[0].tokens(split, block, doc_ids)


_PIECES_PER_WORKER = 4
"""Work units per pairing worker below which blocks are encoded in pieces (:func:`_work_units`)."""


def _work_units(
    blocks: dict[int, list[np.ndarray]],
    keys: list[tuple[int, int]],
    costs: list[int],
    num_proc: int,
    chars: np.ndarray,
) -> list[tuple[int, tuple[int, int], int | None, np.ndarray | None]]:
    """The pool's jobs, longest first: ``(cost, key, piece, doc_ids)``.

    A block is one job (``piece`` None). On a small corpus of long documents the few blocks share
    out unevenly over the workers (13 MB in 2 MB blocks is 6-7 jobs for 2 workers), so a block
    over ``1 / (_PIECES_PER_WORKER * num_proc)`` of all characters is encoded in pieces of whole
    documents of about that size (``piece`` 0, 1, ...), each a job of its own; once all of a
    block's pieces are back, its pairing is a job. Documents are encoded independently, so the
    rows are the same either way. On a large corpus (many blocks per worker) nothing is cut.
    """
    target = max(1.0, sum(costs) / (_PIECES_PER_WORKER * num_proc))
    units = []
    for key, cost in zip(keys, costs, strict=True):
        doc_ids = blocks[key[0]][key[1]]
        n = min(len(doc_ids), math.ceil(cost / target))
        pieces = [doc_ids]
        if n > 1:  # (most blocks of a large corpus are not: no per-document work for them)
            run = np.cumsum(chars[doc_ids])
            cuts = np.unique(np.searchsorted(run, run[-1] * np.arange(1, n) / n) + 1)
            pieces = np.split(doc_ids, cuts[(cuts > 0) & (cuts < len(doc_ids))])
        if len(pieces) <= 1:  # small enough, one document, or one document holds nearly all of it
            units.append((cost, key, None, None))
            continue
        for j, ids in enumerate(pieces):
            units.append((int(chars[ids].sum()), key, j, ids))
    return sorted(units, key=lambda u: (-u[0], u[1], u[2] or 0))


def _pool_context() -> Any:
    """``fork`` where the platform has it (workers inherit the pairer and the memory-mapped
    documents, nothing is pickled); the platform's default (spawn) elsewhere."""
    import multiprocessing as mp

    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else None)


def pair_blocks(
    pairer: BlockPairer, blocks: dict[int, list[np.ndarray]], chars: np.ndarray, data: DataConfig, work: Path
) -> tuple[dict, dict[int, list[dict]]]:
    """Every block of both splits paired; returns the split datasets and each split's block statistics.

    With ``num_proc`` 1 the blocks run in this process, in (split, block) order, straight into one
    Arrow file per split. With more, a process pool takes the blocks longest first (cost =
    characters; where there are few blocks per worker, large ones are encoded in pieces first:
    :func:`_work_units`), each worker taking the next job as it finishes (so the workers end close
    together), and writes each block's examples to a file of its own; a split is its block files in
    (split, block) order, read in place (memory-mapped: the prepared folder's shards, written from
    them, are the one copy). The rows are the same for any ``num_proc``.
    """
    from datasets import Dataset
    from tqdm.auto import tqdm

    keys = [(s, b) for s in range(len(SPLITS)) for b in range(len(blocks[s]))]
    num_proc = min(data.num_proc, len(keys))
    counts = " + ".join(f"{len(blocks[s])} {name}" for s, name in enumerate(SPLITS))
    stats: dict[tuple[int, int], dict] = {}
    out_dir = work / "blocks"
    out_dir.mkdir(parents=True, exist_ok=True)
    split_files = [work / f"examples-{name}.arrow" for name in SPLITS]
    with tqdm(total=len(keys), desc=f"pairing ({counts} blocks)", unit=" blocks", dynamic_ncols=True) as bar:
        if num_proc <= 1:
            for s, path in enumerate(split_files):
                with arrow_stream(path, pairer.schema) as writer:
                    for b, doc_ids in enumerate(blocks[s]):
                        table, stats[s, b] = pairer(s, b, doc_ids)
                        writer.write_table(table)
                        bar.update(1)
                        hold("prepare", "paired")  # tests only: stop here until signalled
        else:
            costs = [int(chars[blocks[s][b]].sum()) for s, b in keys]
            _run_pair_pool(pairer, blocks, keys, costs, chars, num_proc, out_dir, stats, bar)
    out, block_stats = {}, {}
    for s, name in enumerate(SPLITS):
        if num_proc <= 1:
            out[name] = Dataset.from_file(str(split_files[s]))
        else:  # the block files in order, memory-mapped: save_to_disk makes the one copy
            out[name] = _joined([_block_file(out_dir, s, b) for b in range(len(blocks[s]))], pairer.schema)
        block_stats[s] = [stats[s, b] for b in range(len(blocks[s]))]
        written = sum(st["examples"] for st in block_stats[s])
        if written != len(out[name]):
            raise RuntimeError(
                f"pairing wrote {len(out[name])} {name} rows but the block statistics count {written}"
            )
    return out, block_stats


def _run_pair_pool(pairer, blocks, keys, costs, chars, num_proc, out_dir, stats, bar) -> None:
    """The blocks ``keys`` through ``num_proc`` worker processes, longest first (:func:`_work_units`);
    statistics into ``stats``."""
    from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    units = _work_units(blocks, keys, costs, num_proc, chars)
    pieces: dict[tuple[int, int], list] = {}  # the encoded pieces of a cut block, as they come back
    for _, key, j, _ in units:
        if j is not None:
            pieces.setdefault(key, []).append(None)
    with ProcessPoolExecutor(
        num_proc,
        mp_context=_pool_context(),
        initializer=_init_pair_worker,
        initargs=(pairer, blocks, out_dir),
    ) as pool:
        futures = {
            pool.submit(_pair_job, *key) if j is None else pool.submit(_tokens_job, *key, ids): (key, j)
            for _, key, j, ids in units
        }
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, timeout=0.5, return_when=FIRST_EXCEPTION)
                for f in done:
                    key, j = futures.pop(f)
                    if j is None:
                        stats[key] = f.result()  # a worker's error is raised here
                        bar.update(1)
                        hold("prepare", "paired")  # tests only: stop here until signalled
                        continue
                    pieces[key][j] = f.result()
                    if all(p is not None for p in pieces[key]):  # the block's pairing, now a job
                        nxt = pool.submit(_pair_job, *key, pieces.pop(key))
                        futures[nxt] = (key, None)
                        pending.add(nxt)
        except BrokenProcessPool:
            stop_pool(pool)
            raise DataError(
                "a pairing worker process ended abruptly (killed, e.g. by the out-of-memory killer); "
                f"with data.num_proc={num_proc} each worker holds one block of data.pairing_block_chars "
                "characters: lower data.num_proc or data.pairing_block_chars"
            ) from None
        except BaseException:  # an error or an interruption: end the workers now
            stop_pool(pool)
            raise


def _joined(files: list[Path], schema: pa.Schema) -> Any:
    """The block files' rows, in order, as one ``Dataset`` over the memory-mapped files (no copy:
    the prepared folder's shards are written from it once, by ``save_to_disk``).

    One ``Dataset`` over the files' tables, concatenated: a ``Dataset`` per file (``from_file``,
    then ``concatenate_datasets``) hashes each one's state for its fingerprint, ~1 ms a file, which
    is 0.5 s for the ~500 blocks of a 1 GB corpus. The fingerprint (``datasets``' own, for its cache
    of transformations, which prepare does not use) is one of the file names instead.
    """
    import xxhash
    from datasets import Dataset
    from datasets.table import MemoryMappedTable, concat_tables

    tables = [t for t in (MemoryMappedTable.from_file(str(path)) for path in files) if t.num_rows]
    if not tables:
        return Dataset(pa.Table.from_batches([], schema))
    fingerprint = xxhash.xxh3_64_hexdigest("\0".join(map(str, files)).encode())
    return Dataset(tables[0] if len(tables) == 1 else concat_tables(tables), fingerprint=fingerprint)
