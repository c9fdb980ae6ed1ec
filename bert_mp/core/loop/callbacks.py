"""The callback protocol, the state plumbing of callbacks, and the monitors every loop can use.

Callbacks observe; they do not steer. Each hook gets the loop state and a ``logs`` / ``summary``
dict; a callback may ADD its own namespaced keys there (the loop writes the dict after every
callback ran) and may set ``state.stop_reason`` to ask the loop to save and stop. Nothing else.
``on_step_end`` also gets the step's raw facts (a :class:`LoopStepFacts`, extended by each loop:
pretraining's loss sums, token counts and FLOPs live in :mod:`bert_mp.pretrain.monitors`);
turning them into metrics is the monitors' job.

A callback's own running figures are its ``state_dict()``, saved in every checkpoint under the
callback's name and restored on resume, so a resumed run reports the whole run even when the list
of callbacks was reordered.
"""

from __future__ import annotations

import math
import resource
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from bert_mp.core.loop.state import LoopState


@dataclass
class LoopStepFacts:
    """What every loop knows about an optimizer step it took (a loop's own facts extend it)."""

    lr: float
    """Learning rate the step used."""
    grad_norm: float
    """Gradient norm before clipping (unscaled)."""
    step_time_s: float
    """Wall time of the step (pretraining: data wait included, shared evenly by the steps of a read)."""


@dataclass
class TrainContext:
    """What callbacks may read about the run (static for its whole length)."""

    cfg: Any
    device: torch.device
    precision: dict
    """``PrecisionPlan.describe()``."""
    num_processes: int
    is_main_process: bool
    scaler: Any = None
    """The GradScaler in use (fp16) or None."""


class Callback(Protocol):
    """What a loop calls; :class:`BaseCallback` gives no-op hooks to override."""

    name: str
    """The callback's key in a checkpoint (its registry name), so state survives a reordered list."""

    def on_train_start(self, state: LoopState, ctx: TrainContext) -> None: ...
    def on_step_end(self, state: LoopState, facts: LoopStepFacts, logs: dict) -> None: ...
    def on_eval_end(self, state: LoopState, logs: dict) -> None: ...
    def on_train_end(self, state: LoopState, summary: dict) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, d: dict) -> None: ...


class BaseCallback:
    """No-op hooks; built-in monitors override what they use."""

    name = ""
    """Set by each monitor class (and by the registry for the callbacks it builds)."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.ctx: TrainContext | None = None

    def on_train_start(self, state: LoopState, ctx: TrainContext) -> None:
        self.ctx = ctx

    def on_step_end(self, state: LoopState, facts: LoopStepFacts, logs: dict) -> None:
        pass

    def on_eval_end(self, state: LoopState, logs: dict) -> None:
        pass

    def on_train_end(self, state: LoopState, summary: dict) -> None:
        pass

    def state_dict(self) -> dict:
        """JSON-able running figures (none for a stateless callback)."""
        return {}

    def load_state_dict(self, d: dict) -> None:
        pass


# --------------------------------------------------------------------------------------------------
# callback state in checkpoints
# --------------------------------------------------------------------------------------------------
def state_keys(callbacks: Sequence[Callback]) -> list[str]:
    """Each callback's key in a checkpoint: its name (a name listed twice: ``name#2``, ``name#3``, ...)."""
    seen: dict[str, int] = {}
    keys = []
    for cb in callbacks:
        name = cb.name or type(cb).__name__
        seen[name] = seen.get(name, 0) + 1
        keys.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return keys


def callback_states(callbacks: Sequence[Callback]) -> dict[str, dict]:
    """Every callback's ``state_dict()`` by name (what a checkpoint saves)."""
    return {key: cb.state_dict() for key, cb in zip(state_keys(callbacks), callbacks)}


def load_callback_states(callbacks: Sequence[Callback], saved: dict[str, dict]) -> None:
    """Give each callback the state saved under its name; one the checkpoint lacks starts afresh.

    Position-keyed states (``"{i}:{ClassName}"``, the older checkpoint format) load where the same
    class sits at the same position.
    """
    for i, (key, cb) in enumerate(zip(state_keys(callbacks), callbacks)):
        d = saved.get(key, saved.get(f"{i}:{type(cb).__name__}"))
        if d is not None:
            cb.load_state_dict(d)


# --------------------------------------------------------------------------------------------------
# monitors every loop can use
# --------------------------------------------------------------------------------------------------
def peak_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class MemoryMonitor(BaseCallback):
    """Peak device memory: CUDA allocator peak, or the process's peak RSS on CPU (over the whole run,
    the processes before a resume included)."""

    name = "memory"

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.earlier_peak = 0

    def _peak(self) -> int:
        assert self.ctx is not None
        if self.ctx.device.type == "cuda":
            now = int(torch.cuda.max_memory_allocated(self.ctx.device))
        else:
            now = peak_rss_bytes()
        return max(now, self.earlier_peak)

    def state_dict(self) -> dict:
        return {"peak_bytes": self._peak() if self.ctx else self.earlier_peak}

    def load_state_dict(self, d: dict) -> None:
        self.earlier_peak = int(d["peak_bytes"])

    def _peak_reserved(self) -> int | None:
        """CUDA: the caching allocator's peak reservation (what other processes cannot use)."""
        assert self.ctx is not None
        if self.ctx.device.type == "cuda":
            return int(torch.cuda.max_memory_reserved(self.ctx.device))
        return None

    def on_step_end(self, state: LoopState, facts: LoopStepFacts, logs: dict) -> None:
        logs["memory/peak_bytes"] = self._peak()
        reserved = self._peak_reserved()
        if reserved is not None:
            logs["memory/peak_reserved_bytes"] = reserved

    def on_train_end(self, state: LoopState, summary: dict) -> None:
        assert self.ctx is not None
        summary["memory"] = {
            "peak_bytes": self._peak(),
            "kind": "cuda_max_allocated" if self.ctx.device.type == "cuda" else "cpu_peak_rss",
        }
        reserved = self._peak_reserved()
        if reserved is not None:
            summary["memory"]["peak_reserved_bytes"] = reserved


class LossScaleMonitor(BaseCallback):
    """fp16: current loss scale and the number of skipped (overflowed) steps; bf16_pure: the share of
    each update that reached the bf16 weights (``bf16/update_efficiency``); silent otherwise."""

    name = "loss_scale"

    def _scale(self) -> float | None:
        scaler = self.ctx.scaler if self.ctx else None
        if scaler is None or not scaler.is_enabled():
            return None
        return float(scaler.get_scale())

    def on_step_end(self, state: LoopState, facts: LoopStepFacts, logs: dict) -> None:
        scale = self._scale()
        if scale is not None:
            logs["amp/loss_scale"] = scale
            logs["amp/skipped_steps"] = state.skipped_steps
        if self.ctx and (self.ctx.precision or {}).get("name") == "bf16_pure":
            from bert_mp.core.numerics.bf16_updates import update_efficiency_logs

            logs.update(update_efficiency_logs())

    def on_train_end(self, state: LoopState, summary: dict) -> None:
        summary["amp"] = {"loss_scale": self._scale(), "skipped_steps": state.skipped_steps}


def finite_or_none(x: Any) -> Any:
    """JSON-friendly value: NaN/inf floats become None."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
