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
"""Written last into a prepared folder, holding the time of the build: the build finished. Not a
manifest like a checkpoint's ``COMPLETE`` (which lists sizes and digests and is verified before a
load): a prepared folder is built under a temporary name and renamed into place whole, and its bytes
are vouched for by ``stats.json``'s ``fingerprint``, which a resume compares."""
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
