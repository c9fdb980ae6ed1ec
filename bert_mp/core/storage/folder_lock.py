"""One writer per folder: an OS lock (``fcntl.flock``) on a file inside it, held for the writer's life.

The lock belongs to the process that took it: the kernel drops it when that process ends, however it
ends (SIGKILL, a crash, the OOM killer), so a folder is never left locked by a process that is gone,
and the next writer takes it over without a question. The lock file also says who holds it (host,
pid, command, since when), for the line that refuses a second writer; it is removed when the holder
lets go, and a taker checks that the file it locked is still the one at that path (a file unlinked
under it is locked again), so removing it is safe. A second writer is refused (:func:`take`: a run
folder), or waits until the holder lets go or dies (:func:`take_waiting`: the build of a prepared
data folder, whose result the waiter then reuses).

Some file systems cannot lock (certain network file systems answer ``ENOLCK`` or ``EOPNOTSUPP``):
:func:`take` then returns an unlocked :class:`FolderLock` whose ``problem`` says why, and the caller
says so and goes on. The library ``filelock`` was not used: its releases before 4 truncate the lock
file when they open it (a refused second writer would erase the holder's record), and its Unix lock
turns into a soft lock on such file systems instead of saying so.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

LOCK_FILE = "bert-mp.lock"
CANNOT_LOCK = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL})
"""What ``flock`` answers on a file system that cannot lock (NFS without a lock daemon, some FUSE
mounts): the folder is used unlocked, with a warning."""
_BUSY = frozenset({errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES})


@dataclass(frozen=True)
class Holder:
    """Who holds a folder: written into the lock file by the holder, read by whoever is refused."""

    host: str
    pid: int
    command: str
    since: str
    launcher_pid: int | None = None
    """The ``bert-mp launch`` the holder runs under, where there is one (the process to stop)."""

    def describe(self) -> str:
        under = f", under bert-mp launch pid {self.launcher_pid}" if self.launcher_pid else ""
        return f"pid {self.pid} on {self.host}{under}, `{self.command}`, since {self.since}"

    @property
    def stop_pid(self) -> int:
        """The process a SIGTERM stops the holder through (its launcher, where it has one)."""
        return self.launcher_pid or self.pid


class FolderInUse(Exception):
    """The folder is locked by a live process; ``holder`` is its record (None where unreadable)."""

    def __init__(self, path: Path, holder: Holder | None):
        super().__init__(str(path))
        self.path, self.holder = path, holder


def this_command(argv: list[str] | None = None) -> str:
    """The command line of this process, as a user typed it (``bert-mp train ...``), shortened."""
    argv = list(sys.argv if argv is None else argv)
    head = Path(argv[0]).name if argv else ""
    if head == "bert-mp" or argv[:1] and argv[0].endswith(os.path.join("bert_mp", "__main__.py")):
        argv = ["bert-mp", *argv[1:]]
    elif argv[:1] in (["-c"], ["-m"]):  # python -c CODE / -m MODULE: the interpreter, then the option
        argv = [sys.executable, *argv]
    text = shlex.join(argv)
    return text if len(text) <= 300 else text[:297] + "..."


def me(launcher_pid: int | None = None) -> Holder:
    """This process as a holder."""
    since = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())
    return Holder(socket.gethostname(), os.getpid(), this_command(), since, launcher_pid)


@dataclass
class FolderLock:
    """A held lock (``fd`` set), or a folder used unlocked (``problem`` says why)."""

    path: Path
    fd: int | None = None
    problem: str | None = None
    created: tuple[Path, ...] = ()
    """Folders made for the lock (the folder, then missing parents): removed on release while empty."""
    owner: int = field(default_factory=os.getpid)
    """The process that took it (a forked child shares the lock and must never remove the file)."""

    def release(self) -> None:
        """Let go: the file is removed while still locked (see the module docstring), then closed."""
        if self.fd is None or os.getpid() != self.owner:
            return
        with contextlib.suppress(OSError):
            if _same_file(self.path, self.fd):
                self.path.unlink()
        os.close(self.fd)
        self.fd = None
        with contextlib.suppress(ValueError):
            _HELD.remove(self)
        for folder in self.created:  # nothing else written there: left as it was found
            try:
                folder.rmdir()
            except OSError:
                break

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _same_file(path: Path, fd: int) -> bool:
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def read_holder(path: Path) -> Holder | None:
    """The record in a lock file; None where there is none or it does not parse."""
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
        return Holder(
            **{k: d[k] for k in ("host", "pid", "command", "since")}, launcher_pid=d.get("launcher_pid")
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def take(folder: str | Path, holder: Holder) -> FolderLock:
    """Lock ``folder`` (created if missing) for this process, recording ``holder`` in the lock file.

    Raises :class:`FolderInUse` when a live process holds it; returns an unlocked :class:`FolderLock`
    with ``problem`` set where the file system cannot lock. Costs a few system calls, once.
    """
    path = Path(folder) / LOCK_FILE
    created = tuple(p for p in (path.parent, *path.parent.parents) if not p.exists())
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        existed = path.exists()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in _BUSY:
                raise FolderInUse(path, read_holder(path)) from None
            if e.errno in CANNOT_LOCK:
                if not existed:  # a lock file nobody can hold says nothing: not left behind
                    path.unlink(missing_ok=True)
                name = errno.errorcode.get(e.errno or 0, e.errno)
                return FolderLock(path, None, f"{e.strerror or e} ({name})", created)
            raise
        if _same_file(path, fd):  # not a file its last holder removed while this one waited to lock it
            break
        os.close(fd)
    record = (json.dumps(asdict(holder)) + "\n").encode("utf-8")
    lock = FolderLock(path, fd, created=created)
    try:
        os.pwrite(fd, record, 0)
        os.ftruncate(fd, len(record))  # written over, then cut: a reader never sees an empty file
    except OSError:  # a full disk: let go, leaving the folder as it was found
        _HELD.append(lock)
        lock.release()
        raise
    _HELD.append(lock)
    return lock


def take_waiting(
    folder: str | Path, holder: Holder, timeout: float | None, on_wait: Callable[[Holder | None], None]
) -> FolderLock:
    """:func:`take`, waiting while a live process holds ``folder``: ``on_wait(its holder)`` once, then
    a retry every :data:`WAIT_POLL_S` until the lock is free (its holder let go or died) or
    ``timeout`` seconds have passed (None: no limit), when :class:`FolderInUse` is raised. A folder
    its last holder removed between two tries (the folders :func:`take` made are removed with the
    lock) is made again."""
    deadline = None if timeout is None else time.monotonic() + timeout
    told = False
    while True:
        try:
            return take(folder, holder)
        except FolderInUse as e:
            if deadline is not None and time.monotonic() >= deadline:
                raise
            if not told:
                on_wait(e.holder)
                told = True
        except FileNotFoundError:  # the folder went with its holder's lock: take it again now
            continue
        time.sleep(
            WAIT_POLL_S if deadline is None else max(0.0, min(WAIT_POLL_S, deadline - time.monotonic()))
        )


WAIT_POLL_S = 0.1
"""How often :func:`take_waiting` tries again (a few system calls a try)."""


_HELD: list[FolderLock] = []
"""The locks this process holds, for :func:`release_all`."""


def release_all() -> None:
    """Let go of every folder this process holds: for a process about to end with ``os._exit`` (an
    interrupted data preparation), which runs no ``finally`` block."""
    for lock in list(_HELD):
        lock.release()
