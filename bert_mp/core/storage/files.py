"""Small file helpers: atomic writes and JSON Lines."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def looks_like_local_path(ref: str) -> bool:
    """Whether a model reference is meant as a local path rather than a Hub id (``name`` or ``org/name``).

    Local: starts with ``/``, ``.`` or ``~``, has a backslash or more than one ``/``, or is ``a/b``
    whose first part exists here (``runs/trian`` next to a ``runs/`` folder). A mistyped local path
    then fails at once instead of spending half a minute in Hub retries.
    """
    if ref.startswith(("/", ".", "~")) or "\\" in ref or ref.count("/") > 1:
        return True
    return "/" in ref and Path(ref.split("/", 1)[0]).expanduser().exists()


def _umask() -> int:
    """The process umask (read by setting and restoring it: there is no read-only call)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str) -> None:
    """Write text so that readers see either the old file or the whole new one, never a part.

    The file gets the mode an ordinary ``open(path, "w")`` would (0666 less the umask), not the
    0600 of the temporary file it is renamed from.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def read_jsonl(path: Path) -> Iterator[dict]:
    """Read a JSON Lines file, skipping a torn last line (a run killed mid-write)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


class JsonlWriter:
    """Append-only JSON Lines writer, flushed per line so a crash loses at most the line in flight."""

    def __init__(self, path: Path, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def write(self, obj: dict) -> None:
        self._f.write(json.dumps(obj, default=float) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()
