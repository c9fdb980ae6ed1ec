"""The training loop's skeleton, written once: pretraining and fine-tuning are subclasses of it.

:class:`TrainingLoop` owns the order of a run and the parts both products run the same way:

- :meth:`~TrainingLoop.run`: hold the run folder (one writer: its lock, then its checks,
  :meth:`~TrainingLoop.check_run_folder`), set up, restore, write ``config.yaml`` (after the restore,
  so a refused resume leaves it as it was), start, then step until done or stopped, with SIGTERM /
  SIGINT (or the launcher gone) turned into a stop after the current step and the ``step`` hold point
  for tests; a :class:`TrainingError` writes a ``failed`` summary and propagates;
- :meth:`~TrainingLoop.update`, the block after a backward: Sophia's Hessian estimate when due, the
  optimizer step, a signal stop, the numerics guard's skip accounting, then the scheduler and the step
  count (a step the fp16 scaler skipped advances neither);
- saving (plain, or discarding the gradients of a step whose loss is not finite), the stopped end
  (close the bar, save, ``stopped``) and summary.json's common fields.

A product overrides only what differs: the pieces of the set-up sequence (:mod:`.setup`: its
checks, batch geometry, data, model, scheduler, the objects it prepares and checkpoints, callbacks),
:meth:`~TrainingLoop.train_step` (fetch a batch, forward/backward, then ``update``, then its
records), :meth:`~TrainingLoop.hessian_loss`, :meth:`~TrainingLoop.complete` (its end-of-run work)
and :meth:`~TrainingLoop.summary_extras`; hooks with a default: ``on_start``, ``flush``,
``precision_record``, ``bar_label``.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from bert_mp.core.checkpoint.store import resolve_resume
from bert_mp.core.engine.strategy import prepare_parts
from bert_mp.core.loop import setup
from bert_mp.core.loop.state import (
    BatchGeometry,
    LoopState,
    flag_signal,
    signal_flag,
    stop_on_signals,
    stop_reason,
)
from bert_mp.core.loop.update import optimizer_step
from bert_mp.core.numerics.precision import library_versions
from bert_mp.core.numerics.subnormal import state_tensors
from bert_mp.core.process.hold import hold
from bert_mp.core.process.launcher import LAUNCHER_GONE, LauncherWatch, launcher_pid, relay_stop
from bert_mp.core.process.notes import tell_launcher_the_run_folder
from bert_mp.core.process.run_dir import announce_resume, check_output_dir, hold_run_folder
from bert_mp.errors import TrainingError

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from bert_mp.core.config import Config, LoopConfig
    from bert_mp.core.engine.strategy import Strategy
    from bert_mp.core.loop.checkpoint_saver import Checkpointer
    from bert_mp.core.loop.numerics_guard import NumericsGuard
    from bert_mp.core.loop.run_log import RunLog
    from bert_mp.core.numerics.hessian import HessianEstimator
    from bert_mp.core.numerics.precision import PrecisionPlan
    from bert_mp.core.process.conditions import Conditions


class TrainingLoop(abc.ABC):
    """One training run: the skeleton both loops share (see the module docstring for what a
    product overrides). ``set_up`` sets the attributes below that have no default (``restore`` sets
    ``resumed_from``)."""

    command: ClassVar[str]
    """The ``bert-mp`` command the run belongs to (``train`` / ``finetune``), named in its lines."""

    cfg: Config
    section: LoopConfig
    """The run's section of the config (``cfg.train`` / ``cfg.finetune``)."""
    state: LoopState
    callbacks: list[Any]
    """Observers of the run; each gets ``on_train_end`` with the summary (empty unless built)."""
    config_changes: dict[str, tuple[Any, Any]]
    """A resume's allowed config changes, ``key -> (old, new)``."""
    warmup_key: ClassVar[str]
    """The section's warmup key, named by the numerics guard."""
    plan: PrecisionPlan
    conditions: Conditions
    geometry: BatchGeometry
    strategy: Strategy
    """The distributed strategy in force (start-up line, summary.json)."""
    accelerator: Accelerator
    log: RunLog
    model: Any
    """The prepared (wrapped) model the loop steps."""
    optimizer: Any
    scheduler: Any
    """Stepped by hand, once per optimizer step that was not skipped."""
    scaler: torch.amp.GradScaler | None
    hessian: HessianEstimator | None
    """Sophia's Hessian estimator (None for every other optimizer)."""
    checkpointer: Checkpointer
    guard: NumericsGuard
    total_steps: int
    """Optimizer steps of a complete run."""
    final_eval_step: int | None = None
    """The step whose evaluation a resume from the final checkpoint logs again (pretraining's)."""
    resume_folder: Path | None = None
    """The checkpoint ``<section>.resume`` names, resolved and verified once before any work."""
    resumed_from: str | None
    """The checkpoint folder this run continued from, or None."""
    launcher: LauncherWatch = LauncherWatch(None)
    """This rank's ``bert-mp launch`` (a run under it stops once it is gone; never without one)."""

    def __init__(self, cfg: Config, section: LoopConfig) -> None:
        self.cfg, self.section = cfg, section
        self.state = LoopState()
        self.callbacks = []

    def run(self) -> dict[str, Any]:
        """Set up, restore, start, then step until done or stopped; end. Returns summary.json's content."""
        # one writer per run folder, from before any work until the run ends (the main process)
        with (
            hold_run_folder(self.section, check=self.check_run_folder),
            contextlib.closing(LauncherWatch.from_env()) as launcher,
        ):
            self.launcher = launcher
            self.set_up()
            tell_launcher_the_run_folder(self.section.output_dir)
            self.restore()
            self.log.write_config()  # after the restore: a refused resume leaves config.yaml as it was
            self.start()
            try:
                with stop_on_signals(self.state):
                    while self.state.step < self.total_steps and not self.state.stop_reason:
                        self.train_step()
                        hold("step", self.state.step)  # tests only: stop here until signalled
            except TrainingError as e:
                self.finish("failed", error=str(e))
                raise
            return self.end()

    # ---- what a product builds and runs ------------------------------------------------------------
    def check_run_folder(self) -> None:
        """Before any work, with the run folder held: refuse a silent reuse of it (or a resume that
        changes the weights' shape) and keep a resume's allowed config changes; resolve and verify the
        checkpoint a resume names (a mistake there costs no start-up). Only reads."""
        self.config_changes = check_output_dir(self.cfg, self.section)
        if self.section.resume:
            checkpoints = Path(self.section.output_dir) / "checkpoints"
            self.resume_folder = resolve_resume(
                self.section.resume, checkpoints, key=f"{self.section.SECTION}.resume"
            )

    def set_up(self) -> None:
        """Build the run's parts in the one set-up sequence (:func:`bert_mp.core.loop.setup.set_up`)."""
        setup.set_up(self)

    # ---- the set-up sequence's pieces (called in the order of bert_mp.core.loop.setup) ---------------
    def check_inputs(self) -> None:
        """What the product checks before anything is built (nothing by default)."""
        return

    @abc.abstractmethod
    def batch_geometry(self, processes: int) -> BatchGeometry:
        """One step's batch over ``processes`` (a batch they cannot split is one line)."""

    @abc.abstractmethod
    def load_data(self) -> None:
        """The product's data (and ``total_steps`` where it depends on it)."""

    @abc.abstractmethod
    def build_model(self) -> Any:
        """The unwrapped model, built under the run's seed."""

    def wrap_model(self, model: Any) -> Any:
        """The model the optimizer trains, after the precision's weight storage (the model itself by default)."""
        return model

    @abc.abstractmethod
    def build_scheduler(self, optimizer: Any) -> Any:
        """The learning-rate schedule of ``optimizer``."""

    def configure_engine(self) -> None:
        """The engine's settings before ``prepare`` (none by default)."""
        return

    def prepare(self, model: Any, optimizer: Any) -> tuple[Any, Any]:
        """``accelerator.prepare`` of the model and optimizer (a model bert_mp sharded as it is)."""
        return prepare_parts(self.accelerator, model, optimizer)

    def checkpointed(self) -> tuple[Any, ...]:
        """Objects saved and restored beside the scheduler (none by default)."""
        return ()

    def build_callbacks(self) -> list[Any]:
        """The run's observers (none by default)."""
        return []

    @abc.abstractmethod
    def train_step(self) -> None:
        """One optimizer step: fetch the batch, forward/backward, :meth:`update`, then record."""

    @abc.abstractmethod
    def hessian_loss(self, batch: Any) -> Callable[[], torch.Tensor]:
        """The loss of ``batch`` as a closure, for Sophia's Hessian estimate (see :meth:`update`)."""

    @abc.abstractmethod
    def complete(self) -> dict[str, Any]:
        """A run that reached ``total_steps``: the product's end-of-run work, then ``finish("completed", ...)``."""

    @abc.abstractmethod
    def summary_extras(self, **results: Any) -> dict[str, Any]:
        """The product's summary.json fields; ``results`` are what :meth:`complete` passed to ``finish``."""

    # ---- restore and start -------------------------------------------------------------------------
    def restore(self) -> None:
        """Model, optimizer, scheduler, scaler, RNG, loop and callback state from ``<section>.resume``."""
        self.resumed_from = self.checkpointer.restore(self.section.resume, self.resume_folder, self.state)

    def start(self) -> None:
        """Open the run log (a resume keeps its rows), the product's start, the clock and the progress bar."""
        s = self.state
        self.log.open(
            s.step if self.resumed_from else None,
            rerun_eval_step=self.final_eval_step,
            changes=self.config_changes,
        )
        announce_resume(self.accelerator, self.command, self.resumed_from, s.step, self.config_changes)
        self.on_start()
        self.checkpointer.start_clock(s)
        self.log.start_bar(self.total_steps, s.step, self.bar_label())
        self.model.train()

    def on_start(self) -> None:
        """The product's start, after the log opens and before the clock starts (nothing by default)."""
        return

    def start_callbacks(self, context_type: type, **extra: Any) -> Any:
        """Start every callback with the run's context: a ``context_type`` (the callbacks' context class
        of the product) built from what every loop knows plus the product's ``extra`` fields."""
        acc = self.accelerator
        ctx = context_type(
            cfg=self.cfg,
            device=acc.device,
            precision=self.plan.describe(self.scaler),
            num_processes=acc.num_processes,
            is_main_process=acc.is_main_process,
            scaler=self.scaler,
            **extra,
        )
        for cb in self.callbacks:
            cb.on_train_start(self.state, ctx)
        return ctx

    def bar_label(self) -> str:
        return self.command

    # ---- one step's update -------------------------------------------------------------------------
    def update(self, stop: bool | float, batch: Any) -> tuple[float, Any, bool]:
        """After the backward: the optimizer step and its accounting; returns ``(lr, grad_norm, skipped)``.

        ``stop`` is the step's all-reduced signal flag (its value names the signal:
        :func:`bert_mp.core.loop.state.flag_signal`; a bool does not): every rank ends the run after this step.
        ``batch`` is what :meth:`hessian_loss` reads when Sophia's estimate is due.
        """
        s = self.state
        if self.hessian is not None and self.hessian.due(s.step):
            self.hessian.estimate(self.model, self.hessian_loss(batch), s.step, self.scaler)
        lr = self.scheduler.get_last_lr()[0]
        grad_norm, skipped = optimizer_step(
            self.accelerator, self.optimizer, self.model.parameters(), self.section.max_grad_norm, self.scaler
        )
        if stop:  # decided from the all-reduced flag, so every rank stops at this step
            self.stop_for_signal(0.0 if isinstance(stop, bool) else float(stop))
        self.guard.after_step(skipped, s, self.save)
        if not skipped:
            self.scheduler.step()
            s.step += 1
        return lr, grad_norm, skipped

    def stop_flag(self) -> float:
        """This rank's part of the step's all-reduced stop flag, at the step boundary: a signal caught
        here, or this rank's ``bert-mp launch`` gone (checked now: one ``select``)."""
        s = self.state
        if s.pending_signal is None and self.launcher.gone():
            s.pending_signal = LAUNCHER_GONE
        return signal_flag(s.pending_signal)

    def stop_for_signal(self, flag: float = 0.0) -> None:
        """End the run after this step: a signal arrived here (or the launcher is gone), or (the
        all-reduced ``flag``, which names the cause: :func:`bert_mp.core.loop.state.flag_signal`) on
        another rank."""
        s = self.state
        cause = s.pending_signal or flag_signal(flag)
        s.stop_reason = s.stop_reason or (stop_reason(cause) if cause else "signal on another rank")

    # ---- save and end ------------------------------------------------------------------------------
    def flush(self) -> None:
        """Log the step rows still pending (pretraining keeps them on the device); nothing by default."""
        return

    def save(self) -> Path:
        self.flush()  # the steps before a checkpoint are read (and checked) before it is written
        return self.checkpointer.save(self.state)

    def save_discarding_gradients(self) -> Path:
        """Save the state before a step whose loss is not finite (its gradients are dropped)."""
        self.optimizer.zero_grad(set_to_none=True)
        return self.save()

    def end(self) -> dict[str, Any]:
        """After the loop: a stopped run saves and stops; a finished one does the product's end-of-run work."""
        self.flush()
        self.log.close_bar()
        if self.state.stop_reason:
            # a second signal (a launcher passing one on) waits for the save; under bert-mp launch
            # any later one is ignored: what is left is the stopped line and the exit
            with stop_on_signals(self.state, then_ignore=_a_rank_of_bert_mp_launch()):
                self.save()
                summary = self.finish("stopped")
                # no rank exits before the summary is written: torch elastic's agent ends the other
                # ranks once one has exited with a stopped run's code
                self.accelerator.wait_for_everyone()
                # a signal that reached another machine: this machine's launcher ends the same way
                relay_stop(self.state.pending_signal, self.state.stop_reason)
            hold("stopped")  # tests only: stop here, with the signals as the exit sees them, until released
            return summary
        return self.complete()

    def finish(self, status: str, error: str | None = None, **results: Any) -> dict[str, Any]:
        """summary.json: the fields every run has, the product's, then what every callback adds."""
        s = self.state
        summary = {
            "status": status,
            "resumed_from": self.resumed_from,
            "steps": s.step,
            "skipped_steps": s.skipped_steps,
            "stop_reason": s.stop_reason,
            "strategy": self.strategy.to_dict() if getattr(self, "strategy", None) else None,
            "precision": self.precision_record(),
            "versions": library_versions(),
            "conditions": self.conditions.at_end(
                state_tensors(getattr(self, "model", None), getattr(self, "optimizer", None))
            ),
            **self.summary_extras(**results),
        }
        if error:
            summary["error"] = error
        for cb in self.callbacks:
            cb.on_train_end(s, summary)
        self.log.finish(summary)
        return summary

    def precision_record(self) -> dict[str, Any]:
        """The summary's ``precision``: what took effect (read now, with the loss scale reached)."""
        return self.plan.describe(self.scaler)


def _a_rank_of_bert_mp_launch() -> bool:
    """A process that torch elastic's agent started under ``bert-mp launch``: one that ends right after
    its run (never the process a loop runs in otherwise, e.g. a test's, which must keep its signals)."""
    import os

    return launcher_pid() is not None and "TORCHELASTIC_RUN_ID" in os.environ
