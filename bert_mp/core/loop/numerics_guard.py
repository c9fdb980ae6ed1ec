"""The numerics guard of every training loop: non-finite losses, fp16 overflow streaks, scale collapse.

Each stop saves the last good state first (through the ``save`` it is given) and then raises
:class:`TrainingError` with what to change; pretraining and fine-tuning stop with the same words.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bert_mp.core.loop.state import LoopState
from bert_mp.errors import TrainingError

# fp16: gradients that overflow even unscaled (scale < 1) mean divergence, not a too-high scale; below
# this the scaler only shrinks the gradients into fp16 underflow and the run silently stops learning.
MIN_LOSS_SCALE = 1.0


@dataclass
class NumericsGuard:
    """Checks one loop section's steps (``section`` names its config keys in the messages)."""

    precision: str
    scaler: Any
    """The GradScaler in use (fp16) or None."""
    max_consecutive_skips: int
    section: str
    warmup_key: str
    """The key that lengthens warmup: ``warmup_steps`` or ``warmup_ratio``."""

    @classmethod
    def for_loop(cls, cfg: Any, scaler: Any, warmup_key: str) -> NumericsGuard:
        return cls(cfg.precision, scaler, cfg.max_consecutive_skipped_steps, cfg.SECTION, warmup_key)

    def check_loss(self, loss: float, state: LoopState, save: Callable[[], Path]) -> None:
        """Without a loss scaler a non-finite loss stops the run; with one the scaler skips the step."""
        if math.isfinite(loss) or self.scaler is not None:
            return
        path = save()
        s = self.section
        raise TrainingError(
            f"non-finite loss ({loss}) at step {state.step + 1} in {self.precision}; state before the step "
            f"saved to {path}. Lower {s}.learning_rate or raise {s}.{self.warmup_key}."
        )

    def check_logged_loss(self, loss: float, step: int, read_at: int, last_good: Path | None) -> None:
        """A loss read back late (``train.metrics_sync=log``): the optimizer has stepped on it already,
        so nothing is saved; the last checkpoint is the last good state."""
        if math.isfinite(loss) or self.scaler is not None:
            return
        s = self.section
        raise TrainingError(
            f"non-finite loss ({loss}) at step {step} in {self.precision}, read back at step {read_at} "
            f"({s}.metrics_sync=log); the model after it is not saved, last good checkpoint: "
            f"{last_good or 'none'}. Lower {s}.learning_rate or raise {s}.{self.warmup_key}; "
            f"{s}.metrics_sync=step stops at the step itself with the state before it saved."
        )

    def after_step(self, skipped: bool, state: LoopState, save: Callable[[], Path]) -> None:
        """Count a skipped (overflowed) step; too many in a row, or a collapsed scale, stops the run."""
        if not skipped:
            state.consecutive_skips = 0
            return
        state.skipped_steps += 1
        state.consecutive_skips += 1
        scale = self.scaler.get_scale()
        collapsed = scale < MIN_LOSS_SCALE
        if state.consecutive_skips < self.max_consecutive_skips and not collapsed:
            return
        path = save()
        why = (
            f"the loss scale collapsed below {MIN_LOSS_SCALE:g} after {state.skipped_steps} overflowed steps"
            if collapsed
            else f"{state.consecutive_skips} optimizer steps in a row overflowed"
        )
        s = self.section
        raise TrainingError(
            f"fp16: {why} (loss scale {self.scaler.get_scale():g}); checkpoint saved to {path}. Try "
            f"{s}.precision=bf16, a lower learning rate, or a smaller {s}.fp16_init_scale."
        )
