"""A fingerprint of a prepared folder's data, and the per-file checksums it is verified by.

The fingerprint tells two builds apart by their data alone, so that two clean builds of one config
(in two folders, on two machines, or a ``--force`` rebuild over unchanged data) give one
fingerprint and a changed token anywhere gives another. What counts as data:

- every ``*.arrow`` file under ``dataset/``: the rows, and the schema with ``datasets``' features
  (which ``datasets`` keeps in the Arrow schema's metadata);
- every file under ``tokenizer/``: the vocabulary, normalizer and special tokens a run encodes
  with. ``tokenizer_config.json`` is hashed without the keys that say how the tokenizer was
  loaded rather than what it is (:data:`LOAD_KEYS`: ``is_local``, ``local_files_only``, ...),
  which ``transformers`` writes back: the same tokenizer loaded from a path or from the Hub cache
  is the same data.

What is bookkeeping, left out: ``datasets``' ``state.json`` (its ``_fingerprint`` is a random value
drawn at every save; the rest lists the Arrow files, which their paths already say),
``dataset_info.json`` (the features again, and empty description fields), ``dataset_dict.json``
(the split names, again in the paths), and the folder's own ``config.yaml``, ``stats.json`` and
``PREPARED`` (they describe the build; ``PREPARED`` holds its time).

The fingerprint is xxh3-128 over each data file's relative path and xxh3-128 digest, in path order.
Those per-file digests are written into the folder's manifest (:data:`MANIFEST`, the format of
:mod:`bert_mp.core.storage.checksums`, every file but the marker: the bookkeeping too), so the build
reads each file once, and a training run verifies the folder file by file before its first step,
naming a file that differs. xxh3 tells two builds apart and finds corruption; it does not guard
against a forger.

The WordPiece vocabulary prepare learns is reproducible (same sample, same vocabulary), so the same
config and corpus give the same bytes on every run; the fingerprint is what a resume compares.

Folders built with earlier forms of the fingerprint (``stats.json``'s ``fingerprint_hash``
``xxh3_128``: xxh3-128 over the path and bytes of every file under ``dataset/`` and ``tokenizer/``,
state.json included; no ``fingerprint_hash``: the same in BLAKE2b-128) are still recognised:
:func:`legacy_fingerprints` computes every form of such a folder in one pass, where a comparison
needs it and only there.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from bert_mp.core.storage.checksums import HASH as FILE_HASH
from bert_mp.core.storage.checksums import file_entry, hash_file, new_hasher

FORM = "xxh3_128/data"
"""``stats.json``'s ``fingerprint_hash`` for this form (a fingerprint of the data files' digests)."""
LEGACY_XXH3 = "xxh3_128"
"""``fingerprint_hash`` of the earlier form: every file's path and bytes, bookkeeping included."""
MANIFEST = "checksums.json"
"""The prepared folder's manifest: size and xxh3-128 of every file but the ``PREPARED`` marker."""
PARTS = ("dataset", "tokenizer")
"""Sub-folders that hold the data (and, under ``dataset/``, ``datasets``' bookkeeping)."""
LOAD_KEYS = frozenset(
    {
        "is_local",
        "local_files_only",
        "name_or_path",
        "_commit_hash",
        "cache_dir",
        "revision",
        "token",
        "use_auth_token",
        "trust_remote_code",
        "subfolder",
        "force_download",
        "proxies",
    }
)
"""Keys of ``tokenizer_config.json`` that record how a tokenizer was loaded, not what it is."""
_TOKENIZER_CONFIG = "tokenizer/tokenizer_config.json"


def is_data(rel: str) -> bool:
    """Whether the file at ``rel`` (relative to the prepared folder, POSIX) is data (module docstring)."""
    return (rel.startswith("dataset/") and rel.endswith(".arrow")) or rel.startswith("tokenizer/")


def data_files(folder: str | Path) -> list[str]:
    """The data files of ``folder``, relative POSIX paths in name order."""
    root = Path(folder)
    found = (
        p.relative_to(root).as_posix() for part in PARTS for p in (root / part).rglob("*") if p.is_file()
    )
    return sorted(rel for rel in found if is_data(rel))


def _normalised_config_digest(path: Path) -> str:
    """xxh3-128 of ``tokenizer_config.json`` as canonical JSON without :data:`LOAD_KEYS`."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return file_entry(path)[FILE_HASH]  # not JSON: its bytes (a verification names it)
    if isinstance(config, dict):
        config = {k: v for k, v in config.items() if k not in LOAD_KEYS}
    h = new_hasher()
    h.update(json.dumps(config, sort_keys=True, ensure_ascii=False).encode("utf-8"))
    return h.hexdigest()


def data_digest(folder: str | Path, rel: str, entry: dict[str, Any] | None = None) -> str:
    """The digest a data file contributes: its xxh3-128 (``entry``'s, from the manifest, where given),
    ``tokenizer_config.json`` normalised first."""
    if rel == _TOKENIZER_CONFIG:
        return _normalised_config_digest(Path(folder) / rel)
    return (entry or file_entry(Path(folder) / rel))[FILE_HASH]


def fingerprint_of(digests: dict[str, str]) -> str:
    """xxh3-128 over each data file's relative path and digest (``{rel: digest}``), in path order."""
    h = new_hasher()
    for rel in sorted(digests):
        h.update(f"{rel}\0{digests[rel]}\n".encode())
    return h.hexdigest()


def data_fingerprint(folder: str | Path, entries: dict[str, dict] | None = None) -> str:
    """The fingerprint of ``folder``'s data: from manifest ``entries`` (``{rel: {"size", "xxh3_128"}}``)
    where given, else hashing each data file."""
    entries = entries or {}
    return fingerprint_of({rel: data_digest(folder, rel, entries.get(rel)) for rel in data_files(folder)})


class _Both:
    """Feeds two hashers at once (one read of a file for both legacy forms)."""

    def __init__(self, *hashers: Any):
        self.hashers = hashers

    def update(self, data: Any) -> None:
        for h in self.hashers:
            h.update(data)


_LEGACY_MEMO: dict[tuple, dict[str, str]] = {}


def legacy_fingerprints(folder: str | Path) -> dict[str, str]:
    """Every form of ``folder``'s fingerprint, in one pass over its files: ``{FORM: ..., LEGACY_XXH3:
    ..., "blake2b": ...}`` (the earlier forms hash every file's path and bytes under :data:`PARTS`).
    Remembered while no file of the folder changes, so a process pays for it once."""
    root = Path(folder)
    files = sorted(p for part in PARTS for p in (root / part).rglob("*") if p.is_file())
    key = (str(root.resolve()), *((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files))
    if key in _LEGACY_MEMO:
        return _LEGACY_MEMO[key]
    xxh3, blake = new_hasher(), hashlib.blake2b(digest_size=16)
    both = _Both(xxh3, blake)
    digests: dict[str, str] = {}
    for path in files:
        rel = path.relative_to(root).as_posix()
        both.update(str(path.relative_to(root)).encode() + b"\0")
        if is_data(rel):
            own = new_hasher()
            hash_file(_Both(xxh3, blake, own), path)
            digests[rel] = _normalised_config_digest(path) if rel == _TOKENIZER_CONFIG else own.hexdigest()
        else:
            hash_file(both, path)
    out = {FORM: fingerprint_of(digests), LEGACY_XXH3: xxh3.hexdigest(), "blake2b": blake.hexdigest()}
    _LEGACY_MEMO[key] = out
    return out


def same_data(recorded: str | None, folder: str | Path, current: str | None, form: str | None) -> bool:
    """Whether the fingerprint ``recorded`` (a checkpoint's, an earlier build's) is of the data in
    ``folder``, whose ``stats.json`` records ``current`` in ``form`` (its ``fingerprint_hash``).

    Equal strings are the same data. A folder of this :data:`FORM` has nothing more to say (an
    earlier form of ``recorded`` hashed ``datasets``' random ``state.json`` and matches no folder
    built since). A folder of an earlier form is hashed once in every form
    (:func:`legacy_fingerprints`), ``recorded`` compared with each. Where either is unknown,
    nothing says they differ."""
    if not recorded or not current or recorded == current:
        return True
    if form == FORM:
        return False
    return recorded in legacy_fingerprints(folder).values()
