"""A fingerprint of a prepared folder's bytes: the dataset and the tokenizer a run trains on.

Recorded in ``stats.json``, in every checkpoint and export, and compared on resume: WordPiece
training is not bit-reproducible, so ``bert-mp prepare --force`` with an unchanged config can give
other token ids under the same cache key; the fingerprint tells the two apart.

The digest is xxh3-128, as in every checksum bert_mp writes (:mod:`bert_mp.core.storage.checksums`):
it tells two builds apart, it does not guard against a forger. At ~17 GB/s it costs a fraction of a
second where BLAKE2b (~0.9 GB/s on the 2-vCPU EPYC of ``docs/benchmarks/``) took ~1.5 s for the 1.3 GB
dataset of a 1 GB corpus, after the build and in one process. A fingerprint recorded as BLAKE2b-128
(the same length; folders and checkpoints made so are still about) is recognised by
:func:`same_data`, which computes that digest of the folder where the two differ.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from bert_mp.core.storage.checksums import hash_file, new_hasher

HASH = "xxh3_128"
"""What ``stats.json``'s ``fingerprint_hash`` names: a folder that records it has no BLAKE2b fingerprint."""
PARTS = ("dataset", "tokenizer")
"""Sub-folders whose files are hashed (config.yaml and stats.json describe them and are left out)."""


def folder_fingerprint(folder: str | Path, blake2b: bool = False) -> str:
    """xxh3-128 (``blake2b``: BLAKE2b-128) over the relative path and bytes of every file under
    :data:`PARTS`, in name order."""
    root = Path(folder)
    h: Any = hashlib.blake2b(digest_size=16) if blake2b else new_hasher()
    for part in PARTS:
        for path in sorted(p for p in (root / part).rglob("*") if p.is_file()):
            h.update(str(path.relative_to(root)).encode() + b"\0")
            hash_file(h, path)
    return h.hexdigest()


def same_data(
    recorded: str | None, folder: str | Path, current: str | None, maybe_blake2b: bool = True
) -> bool:
    """Whether the fingerprint ``recorded`` (a checkpoint's, an earlier build's) is of the bytes in
    ``folder``, whose own is ``current``: equal, or, where ``recorded`` may be a BLAKE2b-128 one (a
    checkpoint does not say; an earlier build's ``stats.json`` names its :data:`HASH`), equal to the
    folder's BLAKE2b-128 fingerprint (one pass over the folder, only where the two differ). Where
    either is unknown, nothing says they differ."""
    if not recorded or not current or recorded == current:
        return True
    return maybe_blake2b and folder_fingerprint(folder, blake2b=True) == recorded
