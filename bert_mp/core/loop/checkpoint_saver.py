"""When and what a training loop checkpoints; the atomic writing itself is :mod:`bert_mp.core.checkpoint.store`.

A checkpoint holds the training state (model, optimizer, scaler, scheduler, RNG of every rank; no
pickle, see :mod:`bert_mp.core.checkpoint.state_codec`) and one JSON payload: the loop state plus the state of
every callback under its name, so a resumed run's monitors cover the whole run (also when the list of
callbacks was reordered). Before each save the free space is compared with the size of the last
checkpoint, and a save that will not fit is warned about once.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bert_mp.core.checkpoint import store as ckpt
from bert_mp.core.loop.callbacks import Callback, callback_states, load_callback_states
from bert_mp.core.loop.state import LoopState
from bert_mp.core.storage import disk as storage
from bert_mp.errors import BertMPWarning


class Checkpointer:
    """Owns a loop's checkpoint timing: every ``save_every`` steps before the end, and on demand."""

    def __init__(self, accelerator: Any, cfg: Any, max_steps: int, callbacks: Sequence[Callback] = ()):
        self.accelerator = accelerator
        self.dir = Path(cfg.output_dir) / "checkpoints"
        self.every, self.total_limit, self.max_steps = cfg.save_every, cfg.save_total_limit, max_steps
        self.resume_key = f"{cfg.SECTION}.resume"
        self.callbacks = list(callbacks)
        self.meta: dict = {}
        """Facts saved with every checkpoint (e.g. the data fingerprint); a restore reads them back."""
        self.restored_meta: dict = {}
        self.last_saved: Path | None = None
        """The newest checkpoint this loop wrote or resumed from (the last good state)."""
        self._clock: tuple[float, float] = (time.perf_counter(), 0.0)
        self._warned_space = False

    def restore(self, resume: str | None, folder: Path | None, state: LoopState) -> str | None:
        """Load ``folder`` (the checkpoint ``resume`` names, resolved) into the accelerator, ``state``
        and the callbacks.

        Returns the folder resumed from, or None for a fresh start (``latest`` with nothing saved).
        """
        if resume and folder is None:
            warnings.warn(
                f"{self.resume_key}=latest: no complete checkpoint in {self.dir}; starting fresh",
                BertMPWarning,
                stacklevel=2,
            )
        if folder is None:
            return None
        payload = ckpt.load_checkpoint(self.accelerator, folder)
        self.last_saved = Path(folder)
        self.restored_meta = payload.get("meta", {})
        state.load_state_dict(payload)
        load_callback_states(self.callbacks, payload.get("callbacks", {}))
        return str(folder)

    def start_clock(self, state: LoopState) -> None:
        """Start timing the loop; a resumed run continues from its checkpointed elapsed time."""
        self._clock = (time.perf_counter(), state.elapsed_s)

    def elapsed(self) -> float:
        """Wall seconds of the whole run, the part before a resume included."""
        start, before = self._clock
        return before + time.perf_counter() - start

    def due(self, step: int) -> bool:
        """A periodic checkpoint falls on ``step`` (the end of the run saves separately)."""
        return bool(self.every) and step % self.every == 0 and step < self.max_steps

    def save(self, state: LoopState) -> Path:
        """Checkpoint now (collective: every rank calls it)."""
        state.elapsed_s = self.elapsed()
        payload = state.state_dict()
        payload["callbacks"] = callback_states(self.callbacks)  # by name: a reordered list still resumes
        payload["meta"] = self.meta
        self.check_room()
        self.last_saved = ckpt.save_checkpoint(
            self.accelerator, self.dir, state.step, payload, self.total_limit, self.resume_key
        )
        return self.last_saved

    def check_room(self) -> None:
        """Warn once when the free space is below the size of the last checkpoint: the next save will
        likely fail (it is written in full before the oldest one is rotated out)."""
        if self._warned_space or self.last_saved is None or not self.accelerator.is_main_process:
            return
        need = storage.folder_bytes(self.last_saved)
        free = storage.free_bytes(self.dir)
        if free is not None and free < need:
            self._warned_space = True
            warnings.warn(
                f"{self.dir}: {storage.human_bytes(free)} free, the last checkpoint took "
                f"{storage.human_bytes(need)}: this save will probably not fit; free disk space or "
                f"lower {self.resume_key.split('.')[0]}.save_total_limit",
                BertMPWarning,
                stacklevel=2,
            )
