"""Write failures as one actionable line: free space, what the write needed, and how to continue.

A full disk (or an I/O error, a read-only mount, a permission) while bert_mp writes a checkpoint, an
export or prepared data must not end in a traceback from deep inside a serializer: the writer removes
its temporary folder and raises :class:`bert_mp.errors.StorageError` with the path, the free space
left, roughly what the write needed, and what to do next.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from bert_mp.errors import StorageError

WRITE_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
)
"""OSError numbers that mean the storage refused the write (not a bug in the caller)."""


def free_bytes(path: str | Path) -> int | None:
    """Bytes free to this user on the filesystem holding ``path`` (its nearest existing parent); None if unknown."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def human_bytes(n: int | float | None) -> str:
    """``1.5 GB``-style size (decimal units, as ``df -H`` prints them); ``unknown`` for None."""
    if n is None:
        return "unknown"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def folder_bytes(folder: str | Path) -> int:
    """Total size of the files under ``folder`` (0 when it does not exist)."""
    folder = Path(folder)
    if not folder.is_dir():
        return 0
    total = 0
    for p in folder.rglob("*"):
        try:
            total += p.stat().st_size if p.is_file() else 0
        except OSError:  # removed while we looked
            continue
    return total


_TORCH_WRITE_FAILURES = ("PytorchStreamWriter failed", "inline_container.cc", "No space left on device")
"""How ``torch.save`` (a sharded engine's checkpoint files) reports a write the disk refused."""


def write_failure(exc: BaseException) -> BaseException | None:
    """The storage error behind ``exc`` (itself or anything in its cause/context chain), or None.

    Libraries wrap OS errors (pyarrow, a worker process re-raising its error), so the chain is walked;
    ``torch.save``'s RuntimeError for a full disk counts too.
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and (e.errno in WRITE_ERRNOS or "No space left" in str(e)):
            return e
        if isinstance(e, RuntimeError) and any(s in str(e) for s in _TORCH_WRITE_FAILURES):
            return e
        e = e.__cause__ or e.__context__
    return None


def reason(exc: BaseException) -> str:
    """The first line of an OS error, without the file name Python appends (the message names it)."""
    exc = write_failure(exc) or exc
    if isinstance(exc, OSError) and exc.strerror:
        return f"[Errno {exc.errno}] {exc.strerror}" if exc.errno else exc.strerror
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def storage_error(
    what: str, where: str | Path, exc: BaseException, needed: int | None, then: str
) -> StorageError:
    """``could not write <what> in <where>: <reason> (<free> free, needs about <needed>); <then>``."""
    need = f", needs about {human_bytes(needed)}" if needed else ""
    return StorageError(
        f"could not write {what} in {where}: {reason(exc)} ({human_bytes(free_bytes(where))} free{need}); {then}"
    )


def remove_quietly(path: str | Path) -> None:
    """Remove a temporary file or folder left by a failed write (it only holds space)."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def replace_folder(tmp: Path, dest: Path) -> None:
    """Rename the finished folder ``tmp`` to ``dest``. An older ``dest`` is renamed aside first
    (``.old-<name>-<random>``) and removed after, so ``dest`` is never seen half-removed."""
    dest = Path(dest)
    if dest.exists():
        old = dest.parent / f".old-{dest.name}-{uuid.uuid4().hex[:8]}"
        os.replace(dest, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, dest)


def write_folder_atomically(
    dest: Path, write: Any, what: str, needed: int | None, then: Any, tmp: Path | None = None
) -> Path:
    """``write(tmp)`` into ``tmp`` (``.tmp-<name>`` beside ``dest`` unless given), then rename it into
    place (:func:`replace_folder`).

    Whatever ends the write early, the temporary folder is removed (``dest`` keeps its old content);
    a storage failure raises :class:`bert_mp.errors.StorageError`: ``what`` could not be written
    (about ``needed`` bytes; None: what had been written when it failed), ``then()`` says what to do.
    """
    dest = Path(dest)
    tmp = Path(tmp) if tmp is not None else dest.with_name(f".tmp-{dest.name}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write(tmp)
        replace_folder(tmp, dest)
    except BaseException as e:
        written = folder_bytes(tmp)
        remove_quietly(tmp)  # whatever ended the write, a partial folder only holds space
        if not isinstance(e, Exception) or write_failure(e) is None:
            raise
        raise storage_error(
            f"{what} {dest.name}", dest.parent, e, needed or written or None, then()
        ) from None
    return dest
