"""Loop state, batch geometry and signal handling shared by pretraining and fine-tuning."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from bert_mp.errors import ConfigError, Interrupted

_NOT_CHECKPOINTED = ("stop_reason", "pending_signal")


@dataclass
class LoopState:
    """Everything a loop needs besides model/optimizer/RNG to continue exactly where it stopped."""

    step: int = 0
    """Optimizer steps done (skipped fp16 steps not counted)."""
    epoch: int = 0
    batch_in_epoch: int = 0
    """Global batches of ``epoch`` already consumed (skipped steps included)."""
    skipped_steps: int = 0
    consecutive_skips: int = 0
    tokens_seen: int = 0
    """Non-padding tokens of the steps taken (pretraining)."""
    examples_seen: int = 0
    """Examples of the steps taken (fine-tuning)."""
    elapsed_s: float = 0.0
    stop_reason: str | None = None
    """Set by a callback (or a signal): the loop saves and stops after the current step."""
    pending_signal: str | None = None
    """A SIGTERM/SIGINT arrived; shared with every rank at the next step's all-reduce."""

    def state_dict(self) -> dict:
        d = asdict(self)
        for k in _NOT_CHECKPOINTED:
            d.pop(k)
        return d

    def load_state_dict(self, d: dict) -> None:
        for k, v in d.items():
            if k not in _NOT_CHECKPOINTED and k in self.__dataclass_fields__:
                setattr(self, k, v)

    def advance_batch(self, batches_per_epoch: int) -> bool:
        """Count one consumed global batch; True when it was the last of its epoch."""
        self.batch_in_epoch += 1
        if self.batch_in_epoch < batches_per_epoch:
            return False
        self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        return True


@dataclass(frozen=True)
class BatchGeometry:
    """How one optimizer step's global batch splits over ranks and micro-batches."""

    global_batch: int
    micro_batch: int
    world: int

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.world

    @property
    def accumulation(self) -> int:
        """Micro-batches per rank per optimizer step."""
        return self.per_rank // self.micro_batch

    @classmethod
    def build(
        cls, global_batch: int, micro_batch: int, world: int, global_key: str, micro_key: str
    ) -> BatchGeometry:
        """Check that the global batch splits evenly; the error names the keys to change."""
        if global_batch % (micro_batch * world):
            raise ConfigError(
                f"{global_key}={global_batch} must be a multiple of {micro_key} ({micro_batch}) x processes ({world})"
            )
        return cls(global_batch, micro_batch, world)


@contextlib.contextmanager
def stop_on_signals(state: LoopState) -> Iterator[None]:
    """SIGTERM / SIGINT ask the loop to save a checkpoint and stop after the current step."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        state.pending_signal = signal.Signals(signum).name

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


STOP_EXIT_CODES = {"signal SIGINT": 130, "signal SIGTERM": 143}
"""Exit codes of a run stopped by a signal (128 + signal number, as a shell reports it)."""
STOPPED_EXIT_CODE = 3
"""Exit code of a run stopped early for another reason (e.g. ``train.parity_action=stop``)."""


def exit_code(summary: dict) -> int:
    """0 only for a completed run: ``bert-mp train && next-step`` must not go on with an unfinished model."""
    if summary["status"] == "completed":
        return 0
    return STOP_EXIT_CODES.get(summary.get("stop_reason") or "", STOPPED_EXIT_CODE)


def outcome_line(command: str, summary: dict, output_dir: str, result: str | None = None) -> str:
    """The line a run of ``bert-mp train`` / ``finetune`` ends with; ``result`` defaults to a stopped
    run's (why it stopped; checkpoint saved)."""
    result = result or f"{summary['stop_reason']}; checkpoint saved"
    return f"bert-mp {command}: {summary['status']} after {summary['steps']} steps ({result}) -> {output_dir}"


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
