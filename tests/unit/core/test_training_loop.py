"""The loop skeleton (:class:`bert_mp.core.loop.skeleton.TrainingLoop`) driven by a fake product with no
model: a completed run, a skipped fp16 step, a signal stop and a failed run each take their path once,
in order, and the summary carries the common fields beside the product's."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import bert_mp.core.loop.skeleton as training_loop
from bert_mp.core.loop.numerics_guard import NumericsGuard
from bert_mp.core.loop.state import LoopState
from bert_mp.errors import TrainingError


class FakeLog:
    def __init__(self, calls: list[str]):
        self.calls, self.summaries = calls, []

    def write_config(self) -> None:
        self.calls.append("write_config")

    def open(self, resumed_step: int | None, rerun_eval_step: int | None = None, changes: Any = None) -> None:
        self.calls.append("open")

    def start_bar(self, total: int, initial: int, desc: str) -> None:
        self.calls.append(f"bar {desc} {initial}/{total}")

    def close_bar(self) -> None:
        self.calls.append("close_bar")

    def finish(self, summary: dict) -> None:
        self.calls.append(f"finish {summary['status']}")
        self.summaries.append(summary)


class FakeCheckpointer:
    def __init__(self, calls: list[str]):
        self.calls = calls

    def restore(self, resume: str | None, folder: Path | None, state: LoopState) -> str | None:
        self.calls.append("restore")
        return None

    def start_clock(self, state: LoopState) -> None:
        self.calls.append("clock")

    def save(self, state: LoopState) -> Path:
        self.calls.append(f"save at {state.step}")
        return Path("checkpoints/step")


class FakeScheduler:
    def __init__(self) -> None:
        self.steps = 0

    def get_last_lr(self) -> list[float]:
        return [0.1 * (self.steps + 1)]

    def step(self) -> None:
        self.steps += 1


class FakeLoop(training_loop.TrainingLoop):
    """A product with no model: each step only runs the shared update. ``signal_at`` / ``remote_stop_at``
    map a step to a signal arriving here / a stop flag set by another rank during it."""

    command = "fake"

    def __init__(
        self,
        total_steps: int,
        signal_at: dict[int, str] | None = None,
        remote_stop_at: tuple[int, ...] = (),
        before_step: dict[int, Callable[[], Any]] | None = None,
    ):
        section = SimpleNamespace(resume=None, max_grad_norm=1.0, output_dir="run", SECTION="fake")
        super().__init__(SimpleNamespace(), section)
        self.planned, self.signal_at, self.remote_stop_at = total_steps, signal_at or {}, remote_stop_at
        self.before_step = before_step or {}
        self.calls: list[str] = []
        self.updates: list[tuple[float, bool]] = []

    def set_up(self) -> None:
        scaler = SimpleNamespace(get_scale=lambda: 1024.0)
        self.calls.append("set_up")
        self.total_steps, self.config_changes = self.planned, {}
        self.plan = SimpleNamespace(describe=lambda scaler: {"name": "fp16"})
        self.conditions = SimpleNamespace(at_end=lambda state=(): {"threads": 1})
        # announce_resume says nothing for a fresh start; a stopped run's ranks meet once it is saved
        self.accelerator = SimpleNamespace(wait_for_everyone=lambda: self.calls.append("barrier"))
        self.log, self.checkpointer = FakeLog(self.calls), FakeCheckpointer(self.calls)
        self.model = SimpleNamespace(
            parameters=lambda: iter(()), train=lambda: self.calls.append("train mode")
        )
        self.optimizer = SimpleNamespace(zero_grad=lambda set_to_none: self.calls.append("zero_grad"))
        self.scheduler, self.scaler, self.hessian = FakeScheduler(), scaler, None
        self.guard = NumericsGuard("fp16", scaler, 2, "fake", "warmup_steps")

    batch_geometry = load_data = build_model = build_scheduler = None  # set_up above builds the fakes

    def train_step(self) -> None:
        s = self.state
        self.calls.append(f"step {s.step}")
        self.before_step.get(s.step, lambda: None)()
        s.pending_signal = s.pending_signal or self.signal_at.get(s.step)
        flag = self.stop_flag()  # as a product does at the step boundary
        stop = flag > 0 or s.step in self.remote_stop_at
        lr, _, skipped = self.update(stop, None)
        self.updates.append((lr, skipped))

    def hessian_loss(self, batch: Any) -> Callable[[], Any]:
        raise AssertionError("no Hessian estimator in this loop")

    def flush(self) -> None:
        self.calls.append("flush")

    def complete(self) -> dict:
        self.calls.append("complete")
        return self.finish("completed", result="done")

    def summary_extras(self, result: str | None = None) -> dict:
        return {"result": result, "scheduler_steps": self.scheduler.steps}


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch) -> None:
    """The fake run's folder (``run``, which the loop holds while it runs) in the test's own folder."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def skips(monkeypatch) -> Iterator[list[bool]]:
    """The optimizer steps the (fake) fp16 scaler skips, in order; unlisted steps are taken."""
    plan: list[bool] = []

    def optimizer_step(accelerator, optimizer, parameters, max_grad_norm, scaler):
        return 0.5, (plan.pop(0) if plan else False)

    monkeypatch.setattr(training_loop, "optimizer_step", optimizer_step)
    yield plan


def start(total: int) -> list[str]:
    """The calls before the first step: set up, restore, config.yaml, then the start."""
    return ["set_up", "restore", "write_config", "open", "clock", f"bar fake 0/{total}", "train mode"]


COMMON = (
    "status",
    "resumed_from",
    "steps",
    "skipped_steps",
    "stop_reason",
    "precision",
    "versions",
    "conditions",
)


def test_a_completed_run_steps_to_the_end_then_completes_once(skips):
    loop = FakeLoop(3)
    ended = []
    loop.callbacks = [SimpleNamespace(on_train_end=lambda state, summary: ended.append(dict(summary)))]
    summary = loop.run()
    assert loop.calls == [
        *start(3),
        "step 0",
        "step 1",
        "step 2",
        "flush",
        "close_bar",
        "complete",
        "finish completed",
    ]
    assert [lr for lr, _ in loop.updates] == pytest.approx([0.1, 0.2, 0.3])  # read before the scheduler steps
    assert set(COMMON) <= set(summary) and "error" not in summary
    assert summary["status"] == "completed" and summary["steps"] == 3 and summary["stop_reason"] is None
    assert summary["precision"] == {"name": "fp16"} and summary["conditions"] == {"threads": 1}
    assert summary["result"] == "done" and summary["scheduler_steps"] == 3
    assert ended == [summary] and loop.log.summaries == [summary]  # callbacks see it before it is written


def test_a_skipped_step_advances_neither_the_scheduler_nor_the_step(skips):
    skips.extend([False, True, False])
    loop = FakeLoop(3)
    summary = loop.run()
    assert [skipped for _, skipped in loop.updates] == [False, True, False, False]
    assert loop.calls.count("step 1") == 2 and loop.calls.count("complete") == 1
    assert summary["steps"] == 3 and summary["skipped_steps"] == 1 and summary["scheduler_steps"] == 3
    assert loop.state.consecutive_skips == 0


@pytest.mark.parametrize(
    ("kw", "reason"),
    [({"signal_at": {1: "SIGTERM"}}, "signal SIGTERM"), ({"remote_stop_at": (1,)}, "signal on another rank")],
)
def test_a_signal_stops_after_its_step_saves_once_and_never_completes(skips, kw, reason):
    loop = FakeLoop(3, **kw)
    summary = loop.run()
    tail = ["step 0", "step 1", "flush", "close_bar", "flush", "save at 2", "finish stopped", "barrier"]
    assert loop.calls == [*start(3), *tail]
    assert summary["status"] == "stopped" and summary["stop_reason"] == reason and summary["steps"] == 2
    assert summary["result"] is None


def test_a_rank_whose_launcher_is_gone_stops_after_its_step_like_a_signal(skips, monkeypatch):
    """``bert-mp launch`` (a stand-in process here) is killed during step 1: the rank sees it at that
    step's boundary, finishes the step, saves once and stops with the reason ``launcher gone``."""
    import subprocess
    import sys

    from bert_mp.core.process import launcher

    stand_in = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    monkeypatch.setenv(launcher.LAUNCHER_PID_ENV, str(stand_in.pid))
    monkeypatch.setattr(launcher, "_started_after_me", lambda pid: False)  # younger than this test: fine
    loop = FakeLoop(5, before_step={1: lambda: (stand_in.kill(), stand_in.wait())})
    summary = loop.run()
    tail = ["step 0", "step 1", "flush", "close_bar", "flush", "save at 2", "finish stopped", "barrier"]
    assert loop.calls == [*start(5), *tail]
    assert summary["status"] == "stopped" and summary["stop_reason"] == "launcher gone"
    assert loop.state.pending_signal == "launcher gone" and summary["steps"] == 2
    # not a rank torch elastic started: this process keeps its signals (a process that ignored
    # SIGTERM would hand that to every process it starts, and Pool.terminate() could not end them)
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN


def test_a_training_error_writes_one_failed_summary_and_propagates(skips):
    skips.extend([False, True, True])  # the guard's limit is 2 overflows in a row
    loop = FakeLoop(5)
    with pytest.raises(TrainingError, match="2 optimizer steps in a row overflowed"):
        loop.run()
    tail = ["step 0", "step 1", "step 1", "flush", "save at 1", "finish failed"]
    assert loop.calls == [*start(5), *tail]
    (summary,) = loop.log.summaries
    assert summary["status"] == "failed" and summary["steps"] == 1 and summary["skipped_steps"] == 2
    assert "in a row overflowed" in summary["error"] and "close_bar" not in loop.calls


def test_saving_for_a_nonfinite_loss_drops_the_gradients_first(skips):
    loop = FakeLoop(1)
    loop.set_up()
    loop.calls.clear()
    assert loop.save_discarding_gradients() == Path("checkpoints/step")
    assert loop.calls == ["zero_grad", "flush", "save at 0"]
