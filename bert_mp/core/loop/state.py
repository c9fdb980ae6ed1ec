"""Loop state, batch geometry and signal handling shared by pretraining and fine-tuning."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from bert_mp.core.process.launcher import LAUNCHER_GONE
from bert_mp.errors import ConfigError

_NOT_CHECKPOINTED = ("stop_reason", "pending_signal")


@dataclass
class LoopState:
    """Everything a loop needs besides model/optimizer/RNG to continue exactly where it stopped."""

    step: int = 0
    """Optimizer steps done (skipped fp16 steps not counted)."""
    epoch: int = 0
    batch_in_epoch: int = 0
    """Global batches of ``epoch`` already consumed (skipped steps included)."""
    data_offset: int = 0
    """Examples of ``epoch``'s order already consumed, where a step does not hold a fixed number of
    them (pretraining's ``data.token_budget``: the next step starts with the example that did not fit)."""
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
    """A SIGTERM/SIGINT arrived, or this rank's launcher is gone (``launcher gone``); shared with every
    rank at the next step's all-reduce."""

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
        """Check that the global batch splits evenly; the error names the keys to change and a value
        of one that works."""
        if global_batch % (micro_batch * world):
            raise ConfigError(
                f"{global_key}={global_batch} must be a multiple of {micro_key} ({micro_batch}) x processes "
                f"({world}); {working_batch(global_batch, micro_batch, world, global_key, micro_key)}"
            )
        return cls(global_batch, micro_batch, world)


def working_batch(global_batch: int, micro_batch: int, world: int, global_key: str, micro_key: str) -> str:
    """What to set so that ``world`` processes split the global batch: the largest micro-batch up to
    ``micro_batch`` that divides each process's share, or (a global batch the processes cannot share
    evenly) the next global batch that ``micro_batch`` x ``world`` divides."""
    if global_batch % world == 0:
        share = global_batch // world
        fit = max(m for m in range(1, min(micro_batch, share) + 1) if share % m == 0)
        return (
            f"with {world} process{'es' if world != 1 else ''} set {micro_key}={fit} "
            f"(accumulation {share // fit}), or change {global_key}"
        )
    step = micro_batch * world
    return f"set {global_key}={-(-global_batch // step) * step} (a multiple of {micro_batch} x {world})"


@contextlib.contextmanager
def stop_on_signals(state: LoopState, then_ignore: bool = False) -> Iterator[None]:
    """SIGTERM / SIGINT ask the loop to save a checkpoint and stop after the current step.

    ``then_ignore``: on leaving, the two signals are ignored instead of restored to their earlier handlers - for a
    rank under ``bert-mp launch`` whose run has stopped and saved: torch elastic's agent sends SIGTERM
    to the ranks still running once another has exited (or once its launcher passes a signal on), and
    under the default handling that SIGTERM ended the rank before its stopped line.
    """
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
            signal.signal(s, signal.SIG_IGN if then_ignore else h)


_FLAG_OF = {"SIGINT": 1.0, "SIGTERM": 1024.0, LAUNCHER_GONE: 1048576.0}
"""A rank's stop flag per cause: the all-reduced sum still tells which cause any rank met (a launcher
gone wins over SIGTERM, SIGTERM over SIGINT) for up to 1023 ranks, so every rank records the same
stop reason (read by thresholds: a float32 sum's rounding never crosses one)."""


def signal_flag(pending_signal: str | None) -> float:
    """This rank's contribution to the step's all-reduced stop flag (0: no signal here)."""
    return _FLAG_OF.get(pending_signal or "", 1.0 if pending_signal else 0.0)


def flag_signal(total: float) -> str | None:
    """The cause an all-reduced stop flag says some rank met (None: none, or not known)."""
    return next((name for name, flag in reversed(_FLAG_OF.items()) if total >= flag), None)


def stop_reason(cause: str) -> str:
    """summary.json's ``stop_reason`` for a stop cause: ``signal SIGTERM``, or ``launcher gone``."""
    return cause if cause == LAUNCHER_GONE else f"signal {cause}"


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
    run's (why it stopped; checkpoint saved), which also says how to continue it."""
    line = f"bert-mp {command}: {summary['status']} after {summary['steps']} steps"
    if result or summary["status"] != "stopped":
        return f"{line} ({result or summary['status']}) -> {output_dir}"
    return (
        f"{line} ({summary['stop_reason']}; checkpoint saved) -> {output_dir}; "
        f"{RESUME_HINT.format(section=command)}"
    )


RESUME_HINT = "continue it with the same command and {section}.resume=latest"
"""How a stopped run goes on (the end of its stopped line); ``section`` is ``train`` or ``finetune``."""
