"""A fingerprint of a prepared folder's bytes: the dataset and the tokenizer a run trains on.

Recorded in ``stats.json``, in every checkpoint and export, and compared on resume: WordPiece
training is not bit-reproducible, so ``bert-mp prepare --force`` with an unchanged config can give
other token ids under the same cache key; the fingerprint tells the two apart.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

PARTS = ("dataset", "tokenizer")
"""Sub-folders whose files are hashed (config.yaml and stats.json describe them and are left out)."""


def folder_fingerprint(folder: str | Path) -> str:
    """blake2b-128 over the relative path and bytes of every file under :data:`PARTS`, in name order."""
    root = Path(folder)
    h = hashlib.blake2b(digest_size=16)
    for part in PARTS:
        for path in sorted(p for p in (root / part).rglob("*") if p.is_file()):
            h.update(str(path.relative_to(root)).encode() + b"\0")
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
    return h.hexdigest()
