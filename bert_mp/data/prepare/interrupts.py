"""Ctrl-C and SIGTERM during ``bert-mp prepare``: one line, no traceback from the forked pairing
workers, none of them left behind (:func:`interrupts_in_this_process_only`)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from bert_mp.core.storage.folder_lock import release_all
from bert_mp.errors import Interrupted


@dataclass
class CaughtSignal:
    """What :func:`interrupts_in_this_process_only` caught: the first Ctrl-C's number, or None."""

    signum: int | None = None


_FLAG_WAIT_S = 0.2
"""How long a forked worker given SIGTERM waits to learn whether its parent is exiting too."""
_ORPHAN_LIMIT_S = 60.0


@contextlib.contextmanager
def interrupts_in_this_process_only(on_exit: Callable[[int], None]) -> Iterator[CaughtSignal]:
    """Ctrl-C and SIGTERM end this process with one line, with no traceback from the processes it
    forks meanwhile (the workers of prepare's ProcessPoolExecutors) and
    none of them left behind.

    A terminal's Ctrl-C goes to the whole foreground process group, and so may a SIGTERM (a job
    scheduler, ``kill -- -PGID``). Forked processes inherit this Python-level handler, which tells
    them apart by pid:

    - the first Ctrl-C: this process raises :class:`Interrupted` (recorded in the yielded
      :class:`CaughtSignal`, so the caller can tell it from the other exceptions that unwinding a
      pool raises on the way); the workers ignore it, and the pool ends them as the exception
      unwinds (``Pool.terminate`` sends SIGTERM, below). One that lands in a ``__del__``, which
      would swallow it, is sent again 10 ms later.
    - SIGTERM, or a second Ctrl-C (the first one's clean-up is taking too long): this process calls
      ``on_exit(signum)`` (remove partial output, say so) and exits at once with ``128 + signum``,
      without unwinding, which a pool whose workers died of the same signal could hang. It first
      sets a flag that its forked processes share and passes SIGTERM on to them.
    - a forked process given SIGTERM waits briefly for that flag. Set: it exits once this process
      is gone, so that no worker dies before its pool, whose handler thread would replace it. Not
      set: the SIGTERM came from ``Pool.terminate`` (after an error or a Ctrl-C), and it exits at
      once, as SIGTERM's default action would.

    A signal that is ignored or has a handler of its own here is left alone.
    """
    import mmap

    caught = CaughtSignal()
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    owner = os.getpid()
    ending = mmap.mmap(-1, 1)  # shared with forked processes: this process is exiting now

    def handler(signum: int, frame: Any) -> None:
        if os.getpid() != owner:
            _in_worker(signum, ending, owner)
        elif signum == signal.SIGINT and caught.signum is None:
            if _in_finalizer(frame):
                threading.Timer(0.01, os.kill, (owner, signum)).start()
                return
            caught.signum = signum
            raise Interrupted(signum)
        else:
            ending[0] = 1
            _signal_children(signal.SIGTERM)
            on_exit(signum)
            release_all()  # the run folder `bert-mp train` holds: os._exit runs no finally block
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + signum)

    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    previous = {s: signal.signal(s, handler) for s, d in defaults.items() if signal.getsignal(s) is d}
    try:
        yield caught
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        ending.close()


def _in_worker(signum: int, ending: Any, owner: int) -> None:
    """The handler in a forked process: ignore Ctrl-C; on SIGTERM exit, after ``owner`` if it is exiting."""
    if signum != signal.SIGTERM:
        return
    deadline = time.monotonic() + _FLAG_WAIT_S
    while not ending[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    if ending[0]:
        deadline = time.monotonic() + _ORPHAN_LIMIT_S
        while os.getppid() == owner and time.monotonic() < deadline:
            time.sleep(0.02)
    os._exit(128 + signum)  # not an exception: one raised inside a __del__ would be swallowed


def _in_finalizer(frame: Any) -> bool:
    """Whether ``frame`` runs inside a ``__del__`` (where Python swallows exceptions)."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _signal_children(signum: int) -> None:
    """Send ``signum`` to every process this one started (and theirs)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.send_signal(signum)
