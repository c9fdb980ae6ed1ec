"""bert_mp.core.process.hold: a named point holds until a signal is handled (or the ready file goes), else nothing."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from bert_mp.core.process import hold

pytestmark = pytest.mark.signals


def _signal_once_ready(ready, signum: int) -> threading.Thread:
    """A thread that sends ``signum`` to this process once ``ready`` exists (after the hold began)."""

    def run() -> None:
        stop = threading.Event()
        while not ready.exists():
            stop.wait(0.005)
        os.kill(os.getpid(), signum)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_unset_or_another_point_returns_at_once(monkeypatch, tmp_path):
    monkeypatch.delenv(hold.HOLD_ENV, raising=False)
    hold.hold("step", 3)
    monkeypatch.setenv(hold.HOLD_ENV, "step:4")
    monkeypatch.setenv(hold.READY_ENV, str(tmp_path / "ready"))
    hold.hold("step", 3)
    assert not (tmp_path / "ready").exists()


def test_another_rank_does_not_hold(monkeypatch, tmp_path):
    monkeypatch.setenv(hold.HOLD_ENV, "step:3")
    monkeypatch.setenv(hold.READY_ENV, str(tmp_path / "ready"))
    monkeypatch.setenv("RANK", "1")
    hold.hold("step", 3)
    assert not (tmp_path / "ready").exists()


def test_holds_until_a_signal_is_handled(monkeypatch, tmp_path):
    """The handler has run when the hold returns: the caller sees the signal's effect at once."""
    ready = tmp_path / "ready"
    monkeypatch.setenv(hold.HOLD_ENV, "checkpoint:6:state")
    monkeypatch.setenv(hold.READY_ENV, str(ready))
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        t = _signal_once_ready(ready, signal.SIGUSR1)
        hold.hold("checkpoint", 6, "state")
        assert seen == [signal.SIGUSR1] and ready.read_text() == "checkpoint:6:state\n"
        t.join()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert signal.set_wakeup_fd(-1) == -1  # the hold put back what was there


def test_a_raising_handler_ends_the_hold_with_its_exception(monkeypatch, tmp_path):
    ready = tmp_path / "ready"
    monkeypatch.setenv(hold.HOLD_ENV, "prepare:paired")
    monkeypatch.setenv(hold.READY_ENV, str(ready))
    t = _signal_once_ready(ready, signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        hold.hold("prepare", "paired")
    t.join()


def test_several_points_hold_at_each_listed_one(monkeypatch, tmp_path):
    """``step:2,stopped``: the hold at step 2, released, then at ``stopped``; not at step 3."""
    ready = tmp_path / "ready"
    monkeypatch.setenv(hold.HOLD_ENV, "step:2,stopped")
    monkeypatch.setenv(hold.READY_ENV, str(ready))
    hold.hold("step", 3)
    assert not ready.exists()
    said = []
    for point in (("step", 2), ("stopped",)):
        released = threading.Thread(target=lambda: _release_once_ready(ready, said), daemon=True)
        released.start()
        hold.hold(*point)
        released.join()
    assert said == ["step:2\n", "stopped\n"]


def _release_once_ready(ready, said: list) -> None:
    """Remove ``ready`` once it exists (the hold began), keeping what it said."""
    stop = threading.Event()
    while not ready.exists():
        stop.wait(0.005)
    said.append(ready.read_text())
    ready.unlink()
