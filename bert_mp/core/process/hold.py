"""Named hold points: a test (or a drill) stops a running command at a known point, then acts on it.

A test that signals or kills a running process must not race it (poll a log file, then send the
signal and hope the run has not finished meanwhile). With ``BERT_MP_HOLD=<point>`` and
``BERT_MP_HOLD_READY=<file>`` in its environment, the command stops when it reaches ``<point>``,
creates the ready file and waits there until a signal arrives (its handler has then run) or the
ready file is removed. So the order - reach the point, then act - holds by construction, at any
machine speed. ``BERT_MP_HOLD`` may name several points, comma-separated: the command holds at each
it reaches, creating the ready file each time (once the test has removed it). Points:

- ``step:N`` - after optimizer step N (pretraining and fine-tuning);
- ``stopped`` - a stopped run, saved, its summary written and its stop passed on to its launcher,
  before its stopped line (pretraining and fine-tuning);
- ``checkpoint:N:STAGE`` - inside the write of checkpoint N (``checkpoint.WRITE_STAGES``);
- ``prepare:paired`` - prepare, once the first block of pairs is back from the pairing workers;
- ``tokenizer:written`` - prepare, once a trained tokenizer is written to its temporary folder.
- ``glue:N`` - ``bert-mp glue``, once the N-th task's results are in glue.json.

Only the main process (``RANK`` unset or 0) holds; the other ranks wait for it at their next
collective. Unset, a hold point costs one dictionary lookup.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from pathlib import Path

HOLD_ENV = "BERT_MP_HOLD"
READY_ENV = "BERT_MP_HOLD_READY"
HOLD_LIMIT_S = 600.0
"""Never hang a run whose test went away: after this long the process goes on."""


def hold(*point: object) -> None:
    """Hold here when ``BERT_MP_HOLD`` names this point (``hold("step", 8)`` is ``step:8``)."""
    want = os.environ.get(HOLD_ENV)
    if not want or ":".join(str(p) for p in point) not in want.split(","):
        return
    if os.environ.get("RANK", "0") != "0":
        return
    if not os.environ.get(READY_ENV):
        raise RuntimeError(
            f"{HOLD_ENV}={want} needs {READY_ENV}: the file to create when the point is reached"
        )
    ready = Path(os.environ[READY_ENV])
    with _signal_pipe() as fd:
        tmp = ready.with_name(ready.name + ".tmp")
        tmp.write_text(":".join(str(p) for p in point) + "\n", encoding="utf-8")
        tmp.replace(ready)  # the test sees the file complete or not at all
        _wait(ready, fd)


def _wait(ready: Path, fd: int | None) -> None:
    """Until a signal is caught (a byte on ``fd``), the ready file is gone, or the time limit."""
    deadline = time.monotonic() + HOLD_LIMIT_S
    while ready.exists() and time.monotonic() < deadline:
        if fd is None:
            time.sleep(0.01)
            continue
        # a caught signal writes a byte to fd (signal.set_wakeup_fd) after its C handler ran; its
        # Python handler runs before select returns (PEP 475), or raises out of it
        if select.select([fd], [], [], 0.05)[0]:
            return


@contextlib.contextmanager
def _signal_pipe():
    """A pipe that every caught signal writes to (the main thread only; else None: poll the file)."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    previous = signal.set_wakeup_fd(w)
    try:
        yield r
    finally:
        signal.set_wakeup_fd(previous)
        os.close(r)
        os.close(w)
