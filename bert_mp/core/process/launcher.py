"""The ``bert-mp launch`` a rank runs under: whether it is still there, and passing a stop on to it.

``bert-mp launch`` puts its own pid in its processes' environment (:data:`LAUNCHER_PID_ENV`). Under
it, a rank's parent is torch elastic's agent (the ``accelerate launch`` process), whose parent is
``bert-mp launch``: when ``bert-mp launch`` is killed (SIGKILL, the OOM killer, a closed job step),
the agent and the ranks live on as orphans and nothing tells them. So each rank watches ``bert-mp
launch`` itself (:class:`LauncherWatch`, a pidfd: one non-blocking ``select`` per step) and, once it
is gone, stops the way a SIGTERM stops it: the step's all-reduced stop flag carries it to every rank
(:func:`bert_mp.core.loop.state.signal_flag`), they finish the step, save together and record the
stop reason ``launcher gone``.

**Relaying a stop.** SIGTERM or Ctrl-C reaches the launcher of one machine, whose ranks pass it on
through the stop flag: every rank of every machine finishes the step and saves. The other machines'
launchers never saw the signal; so the first rank of each (``LOCAL_RANK`` 0), once the run is saved
and its summary written, sends the same signal to its own ``bert-mp launch`` (:func:`relay_stop`),
which ends as the signalled one does: the ranks' stopped line, exit 130 / 143.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
from collections.abc import Mapping

LAUNCHER_PID_ENV = "BERT_MP_LAUNCHER_PID"
"""Set by ``bert-mp launch`` for its processes: the launcher a rank watches and passes a stop on to."""
LAUNCHER_GONE = "launcher gone"
"""The stop reason of a run whose ``bert-mp launch`` went away (on any machine)."""


def launcher_pid(environ: Mapping[str, str] | None = None) -> int | None:
    """The ``bert-mp launch`` this process runs under, or None."""
    value = (os.environ if environ is None else environ).get(LAUNCHER_PID_ENV, "")
    return int(value) if value.isdigit() else None


class LauncherWatch:
    """Whether this process's ``bert-mp launch`` has ended (never, without one)."""

    def __init__(self, pid: int | None) -> None:
        self.pid, self._fd, self._proc, self._gone = pid, None, None, False
        if pid is None:
            return
        try:
            if _started_after_me(pid):  # that pid is another process now: the launcher ended before
                self._gone = True
                return
            self._fd = os.pidfd_open(pid)  # readable once the process has ended, whoever reaps it
        except ProcessLookupError:
            self._gone = True
        except (AttributeError, OSError):  # no pidfd (an old kernel, not Linux): ask psutil each time
            import psutil

            with contextlib.suppress(psutil.Error):
                self._proc = psutil.Process(pid)
            self._gone = self._proc is None

    @classmethod
    def from_env(cls) -> LauncherWatch:
        return cls(launcher_pid())

    def gone(self) -> bool:
        """Checked at the step boundary: one ``select`` with no wait."""
        if self._gone:
            return True
        if self._fd is not None:
            self._gone = bool(select.select([self._fd], [], [], 0)[0])
        elif self._proc is not None:
            self._gone = not self._proc.is_running()
        return self._gone

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _started_after_me(pid: int) -> bool:
    """Whether ``pid`` belongs to a process younger than this one (its pid was reused)."""
    import psutil

    try:
        return psutil.Process(pid).create_time() > psutil.Process().create_time()
    except psutil.NoSuchProcess:
        raise ProcessLookupError(pid) from None
    except psutil.Error:
        return False


# --------------------------------------------------------------------------------------------------
# a stop that reached another machine
# --------------------------------------------------------------------------------------------------
RELAY_WAIT_S = 60.0
"""How long the first rank of a machine waits for its launcher to pass the relayed signal back."""


def relay_stop(pending_signal: str | None, stop_reason: str | None) -> None:
    """After a run stopped for a signal that this machine's launcher never got (it reached another
    machine): the first rank of this machine sends the same signal to its ``bert-mp launch`` and waits
    until the launcher passes it back, so that the launcher has it before this rank exits."""
    launcher = launcher_pid()
    if pending_signal or launcher is None or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    name = (stop_reason or "").removeprefix("signal ")
    if name not in ("SIGTERM", "SIGINT") or threading.current_thread() is not threading.main_thread():
        return
    signum = signal.Signals[name]
    # blocked, so that the signal coming back is taken here (sigtimedwait), not by a handler
    signal.pthread_sigmask(signal.SIG_BLOCK, [signum])
    try:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(launcher, signum)
            signal.sigtimedwait([signum], RELAY_WAIT_S)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
