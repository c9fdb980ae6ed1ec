"""Content checksums: the manifest of a folder bert_mp wrote, and the check before anything is loaded.

A manifest (a checkpoint's ``COMPLETE`` marker, an export's ``checksums.json``) lists files with their
size and their xxh3-128 digest. Files bert_mp writes itself are hashed while they are written
(:class:`HashingWriter`), so a save reads nothing back; files other code wrote (``save_pretrained``,
a sharded engine's own checkpoint files) are hashed after. :func:`check` compares a folder with its
manifest - sizes first (cheap), then every digest - and says what is wrong in a few words. A flipped
bit, a truncated or an overwritten file is found before any byte of it is deserialized.

Manifests written before checksums existed (``{"files": {name: size}}``) still verify, by size alone;
:attr:`Verdict.hashed` tells the caller to say so.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from bert_mp.core.storage.files import atomic_write_json

HASH = "xxh3_128"
"""Digest of every file: xxh3-128 (non-cryptographic: it detects corruption, not a forger; see docs/reliability.md)."""
FORMAT = 2
"""Manifest format with sizes and digests; format 1 (no ``format`` key) held sizes only."""
_CHUNK = 8 << 20


def new_hasher() -> Any:
    return xxhash.xxh3_128()


def hash_file(h: Any, path: str | Path) -> int:
    """Feed a file's bytes to the hasher ``h`` (anything with ``update``), read in chunks; its size."""
    size = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size


def file_entry(path: str | Path) -> dict[str, Any]:
    """``{"size": bytes, "xxh3_128": hex}`` of a file, read in chunks."""
    h = new_hasher()
    size = hash_file(h, path)
    return {"size": size, HASH: h.hexdigest()}


class HashingWriter:
    """A binary file being written, hashed as it goes; :meth:`close` syncs it and returns its entry.

    ``open(path, "xb")``: a stale file is never appended to or silently replaced.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._f = open(self.path, "xb")  # noqa: SIM115 (closed by close())
        self._h = new_hasher()
        self.size = 0

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self._f.write(view)
        self._h.update(view)
        self.size += view.nbytes

    def close(self) -> dict[str, Any]:
        """Flush and fsync (the manifest must never be on disk before the bytes it vouches for)."""
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return {"size": self.size, HASH: self._h.hexdigest()}

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._f.close()

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is not None:
            self.abort()


def write_json(path: str | Path, obj: Any) -> dict[str, Any]:
    """A small JSON file written through :class:`HashingWriter`; returns its manifest entry."""
    with HashingWriter(path) as w:
        w.write((json.dumps(obj, indent=2, default=str) + "\n").encode("utf-8"))
        return w.close()


def _files(folder: Path, skip: str) -> list[Path]:
    return [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != skip]


def write_manifest(
    folder: str | Path, name: str, known: dict[str, dict] | None = None, only: Any = None
) -> dict[str, dict]:
    """Write manifest ``name`` in ``folder`` listing its files (``only(relpath)`` filters them).

    Entries in ``known`` (hashed while written) are taken as they are when the size on disk agrees;
    every other file is read and hashed here.
    """
    files = manifest_entries(folder, name, known, only)
    atomic_write_json(Path(folder) / name, {"format": FORMAT, "hash": HASH, "files": files})
    return files


def manifest_entries(
    folder: str | Path, skip: str, known: dict[str, dict] | None = None, only: Any = None
) -> dict[str, dict]:
    """The entries :func:`write_manifest` would write (every file but ``skip``), without writing them."""
    folder, known = Path(folder), known or {}
    files: dict[str, dict] = {}
    for p in _files(folder, skip):
        rel = p.relative_to(folder).as_posix()
        if only is not None and not only(rel):
            continue
        entry = known.get(rel)
        files[rel] = entry if entry and entry["size"] == p.stat().st_size else file_entry(p)
    return files


@dataclass(frozen=True)
class Verdict:
    """What :func:`check` found: ``problem`` None when the folder matches its manifest."""

    problem: str | None
    hashed: bool = True
    """False for a size-only (format 1) manifest: the contents were not compared."""
    files: tuple[str, ...] = ()
    """The files the manifest lists."""


def read_manifest(path: Path) -> tuple[dict[str, dict] | None, bool, str | None]:
    """``(files as {name: {"size", ...}}, hashed, problem)`` of a manifest file."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, False, "unreadable"
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
        return None, False, "unreadable"
    fmt = doc.get("format", 1)
    if fmt == 1 and all(isinstance(v, int) and not isinstance(v, bool) for v in doc["files"].values()):
        return {k: {"size": v} for k, v in doc["files"].items()}, False, None
    if fmt != FORMAT or doc.get("hash") != HASH:
        return (
            None,
            False,
            f"of an unknown format ({fmt!r}, hash {doc.get('hash')!r}; written by a newer bert_mp?)",
        )
    ok = all(
        isinstance(e, dict)
        and isinstance(e.get("size"), int)
        and isinstance(e.get(HASH), str)
        and not isinstance(e.get("size"), bool)
        for e in doc["files"].values()
    )
    return (doc["files"], True, None) if ok else (None, False, "unreadable")


def _compare(folder: Path, files: dict[str, dict], hashed: bool) -> str | None:
    for name, entry in files.items():  # sizes first: a truncated file needs no hashing to be found
        path = folder / name
        if not path.is_file():
            return f"missing file {name}"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{name} has {size} bytes, expected {entry['size']} (truncated or altered)"
    if hashed:
        for name, entry in files.items():
            if file_entry(folder / name)[HASH] != entry[HASH]:
                return f"{name} does not match its checksum (corrupted or altered since it was written)"
    return None


_MEMO: dict[tuple[str, str], tuple[tuple, Verdict]] = {}
"""Verdicts by folder, valid while no file in it changed (size, mtime and inode of every file)."""


def _signature(folder: Path) -> tuple:
    out = []
    for p in sorted(folder.rglob("*")):
        try:
            st = p.stat()
        except OSError:
            continue
        out.append((p.relative_to(folder).as_posix(), st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def check(folder: str | Path, name: str, absent: str, label: str | None = None) -> Verdict:
    """Compare ``folder`` with its manifest ``name`` (``label`` in messages); ``absent`` is the problem
    when there is none.

    Hashing a large checkpoint takes a moment, so a verdict is remembered for as long as no file in
    the folder changed (a resume checks the same folder from several places).
    """
    folder = Path(folder)
    marker = folder / name
    if not marker.is_file():
        return Verdict(absent, files=())
    key = (str(folder.resolve()), name)
    sig = _signature(folder)
    memo = _MEMO.get(key)
    if memo and memo[0] == sig:
        return memo[1]
    files, hashed, problem = read_manifest(marker)
    if files is None:
        label = label or name
        verdict = Verdict(f"unreadable {label}" if problem == "unreadable" else f"{label} {problem}")
    else:
        verdict = Verdict(_compare(folder, files, hashed), hashed, tuple(files))
    _MEMO[key] = (sig, verdict)
    return verdict


def remember(folder: str | Path, name: str) -> None:
    """Record a folder this process has just written as verified: its manifest's digests were taken
    while writing, so rotating or resuming in the same process need not read it back."""
    folder = Path(folder)
    files, hashed, problem = read_manifest(folder / name)
    if files is not None and hashed:
        _MEMO[(str(folder.resolve()), name)] = (_signature(folder), Verdict(None, True, tuple(files)))
