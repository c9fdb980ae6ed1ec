"""The prepared folder on disk: where a data config's folder lives, whether it is complete, and loading it.

What training, export and the run guard import; it needs nothing of the build.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bert_mp.core.config import DataConfig
from bert_mp.errors import DataError

SPLITS = ("train", "validation")
MARKER = "PREPARED"
"""Written last into a prepared folder, holding the time of the build: the build finished. The files
are listed with their sizes and digests in ``checksums.json`` (:data:`bert_mp.data.fingerprint.MANIFEST`),
which training verifies (:func:`verify_prepared`); the folder is built under a temporary name and
renamed into place whole."""
LEGACY_MARKERS = ("COMPLETE",)
"""The marker's earlier name, still read, so that a cache built before the rename is found."""


@dataclass
class PreparedData:
    """A prepared data folder, loaded."""

    dataset: Any
    """``datasets.DatasetDict`` with ``train`` and ``validation``."""
    tokenizer: Any
    stats: dict
    path: Path


def cache_path(data: DataConfig) -> Path:
    """Where the data for this config lives: ``<cache_dir>/<cache_key>``."""
    return Path(data.cache_dir) / data.cache_key()


def is_complete(path: Path) -> bool:
    """Whether ``path`` holds a finished build (its :data:`MARKER` is written last)."""
    return any((Path(path) / name).is_file() for name in (MARKER, *LEGACY_MARKERS))


def verify_prepared(path: str | Path) -> str:
    """Check a complete prepared folder against what its build recorded, before training reads it:
    every file against the manifest (:data:`~bert_mp.data.fingerprint.MANIFEST`: sizes, then
    xxh3-128 digests); a folder built without one, its files against the fingerprint its
    ``stats.json`` records (one pass, in the form it names). A difference is one line naming the
    file (where a manifest says which) and what to do (:class:`DataError`, exit 2); otherwise a line
    saying what was verified and how long it took. A folder verified earlier in this process and
    unchanged since (or built by it) is not read again."""
    import time

    from bert_mp.core.storage import checksums
    from bert_mp.core.storage.disk import human_bytes
    from bert_mp.data.fingerprint import MANIFEST, legacy_fingerprints

    path, t0 = Path(path), time.perf_counter()
    rebuild = "rebuild it with bert-mp prepare --force (the same config), or restore it from a copy"
    if (path / MANIFEST).is_file():
        verdict = checksums.check(path, MANIFEST, f"no {MANIFEST}", MANIFEST)
        if verdict.problem:
            raise DataError(f"the prepared data {path} failed its check: {verdict.problem}; {rebuild}")
        size = sum((path / rel).stat().st_size for rel in verdict.files)
        what = f"{len(verdict.files)} files, {human_bytes(size)}, against {MANIFEST}"
    else:
        stats = json.loads((path / "stats.json").read_text(encoding="utf-8"))
        recorded = stats.get("fingerprint")
        if not recorded:
            return f"{path} records no fingerprint: not verified"
        if recorded not in legacy_fingerprints(path).values():
            raise DataError(
                f"the prepared data {path} failed its check: its files differ from the fingerprint {recorded} "
                f"its stats.json records (it has no {MANIFEST} to name the file); {rebuild}"
            )
        what = f"every file against its fingerprint {recorded}: no {MANIFEST}"
    return f"verified {path} ({what}) in {time.perf_counter() - t0:.2f} s"


def check_corpus(data: DataConfig) -> None:
    """The files a build of ``data`` would read exist: called before a command's start-up work, so
    a mistyped path is one line at once. Nothing to check where the prepared folder is complete
    (training reads that, not the corpus)."""
    from bert_mp.data.corpus import LOCAL_SOURCES, resolve_paths

    if data.source in LOCAL_SOURCES and not is_complete(cache_path(data)):
        resolve_paths(data.paths)


def load_prepared(path: str | Path) -> PreparedData:
    """Load a folder written by :func:`bert_mp.data.prepare.build.prepare`; refuses a partial one."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise DataError(f"no prepared data at {path}; run `bert-mp prepare` first")
    if not is_complete(path):
        raise DataError(f"{path} is incomplete (no {MARKER} marker); rerun `bert-mp prepare --force`")
    stats = json.loads((path / "stats.json").read_text(encoding="utf-8"))
    return PreparedData(
        dataset=load_from_disk(str(path / "dataset")),
        tokenizer=AutoTokenizer.from_pretrained(str(path / "tokenizer")),
        stats=stats,
        path=path,
    )


def _folders(patterns: list[str]) -> list[Path]:
    """The folders ``train.prepared`` names (glob patterns expanded, each folder once)."""
    import glob

    found: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise DataError(f"train.prepared: {pattern} matches no folder")
        found += [Path(m) for m in matches if Path(m) not in found]
    return found


def _differing_key(a: DataConfig, b: DataConfig) -> str:
    """The first data setting that changes the prepared bytes and differs between ``a`` and ``b``."""
    from dataclasses import asdict

    ignored = (
        "shard",
        "cache_dir",
        "build_wait_s",
        "num_proc",
        "num_shards",
        "pack_pairs",
        "token_budget",
        "mlm_document_attention",
    )
    da, db = asdict(a), asdict(b)
    return next((k for k in da if k not in ignored and da[k] != db[k]), "?")


def load_prepared_shares(patterns: list[str], data: DataConfig) -> PreparedData:
    """The folders ``patterns`` name (``train.prepared``: the shares of a split prepare, or any prepared
    folders) as one :class:`PreparedData`: in share order, splits concatenated. Every folder must be
    complete, hold the same tokenizer and the data settings of ``data`` (``data.shard`` aside); a
    share named twice is an error, a missing share of ``I/N`` a warning."""
    import hashlib
    import warnings
    from dataclasses import replace

    from datasets import DatasetDict, concatenate_datasets

    from bert_mp.core.config import load_config
    from bert_mp.errors import BertMPWarning

    folders = _folders(patterns)
    want = replace(data, shard="0/1")
    shares: list[tuple[tuple[int, int], Path]] = []
    for folder in folders:
        if not is_complete(folder):
            raise DataError(
                f"train.prepared: {folder} is not a complete prepared folder (run bert-mp prepare)"
            )
        theirs = load_config(str(folder / "config.yaml")).data
        if replace(theirs, shard="0/1").cache_key() != want.cache_key():
            key = _differing_key(theirs, want)
            raise DataError(
                f"train.prepared: {folder} was prepared with data.{key}={getattr(theirs, key)!r}, this run has "
                f"{getattr(want, key)!r}; train with the data settings the folders were prepared with"
            )
        shares.append((theirs.shard_parts(), folder))
    shares.sort(key=lambda s: s[0])
    seen = [s[0] for s in shares]
    if len(set(seen)) != len(seen):
        twice = next(s for s in seen if seen.count(s) > 1)
        raise DataError(f"train.prepared: share {twice[0]}/{twice[1]} is named twice")
    counts = {n for _, n in seen}
    missing = [f"{i}/{n}" for n in counts for i in range(n) if (i, n) not in seen]
    if missing:
        warnings.warn(
            f"train.prepared: share{'s' if len(missing) > 1 else ''} {', '.join(missing)} not given: training on "
            "part of the corpus",
            BertMPWarning,
            stacklevel=2,
        )
    loaded = [load_prepared(folder) for _, folder in shares]
    tokenizers = {(p.path / "tokenizer" / "tokenizer.json").read_bytes() for p in loaded}
    if len(tokenizers) > 1:
        raise DataError(
            "train.prepared: the folders hold different tokenizers; prepare every share with the same "
            "data.tokenizer (or none, of the same corpus: each then learns the same vocabulary)"
        )
    first = loaded[0]
    if len(loaded) == 1:
        return first
    dataset = DatasetDict(
        {split: concatenate_datasets([p.dataset[split] for p in loaded]) for split in SPLITS}
    )
    fingerprints = [str(p.stats.get("fingerprint")) for p in loaded]
    stats = {
        **first.stats,
        "splits": {split: len(dataset[split]) for split in SPLITS},
        "fingerprint": hashlib.sha256(" ".join(fingerprints).encode()).hexdigest()[:16],
        "shares": [str(p.path) for p in loaded],
    }
    return PreparedData(dataset=dataset, tokenizer=first.tokenizer, stats=stats, path=first.path)
