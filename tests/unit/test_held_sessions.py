"""The suite's own cleanup: a command a test started in its own session ends with the test."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time

import psutil
from support import _group_alive, end_own_sessions, own_session

HELD_WITH_A_WORKER = (
    "import signal, subprocess, sys\n"
    "worker = subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()'])\n"
    "print(worker.pid, flush=True)\n"
    "signal.pause()\n"
)


def _ended(p: psutil.Process) -> bool:
    """Gone, or a zombie its new parent has not reaped yet (dead either way)."""
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_held_command_and_its_worker_are_killed_at_teardown():
    proc = own_session(
        subprocess.Popen(
            [sys.executable, "-c", HELD_WITH_A_WORKER],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    )
    worker = psutil.Process(int(proc.stdout.readline()))
    assert _group_alive(proc.pid)
    end_own_sessions()
    assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while not _ended(worker):  # reparented, so not ours to reap: psutil polls it
        assert time.monotonic() < deadline, "the worker outlived its group's teardown"
        with contextlib.suppress(psutil.TimeoutExpired):
            worker.wait(timeout=0.05)
    assert not _group_alive(proc.pid)


def test_a_command_that_ended_is_left_alone():
    proc = own_session(subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True))
    assert proc.wait(timeout=60) == 0
    end_own_sessions()  # nothing left to kill: no error
    assert proc.returncode == 0
