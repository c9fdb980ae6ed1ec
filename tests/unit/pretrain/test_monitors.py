"""pretrain/monitors.py over core/loop/callbacks.py's checkpoint state: a resume gives each monitor its
own history back, by name, whatever the order of ``train.callbacks``."""

from __future__ import annotations

import json

from support import make_prepared, reset_accelerate, tiny_config

from bert_mp.core.loop.callbacks import BaseCallback, MemoryMonitor
from bert_mp.pretrain import monitors
from bert_mp.pretrain.monitors import ThroughputMonitor
from bert_mp.pretrain.trainer import Trainer


class StopAt4(BaseCallback):
    def on_step_end(self, state, facts, logs):
        if state.step == 4:
            state.stop_reason = "test stop at 4"


def _one(trainer: Trainer, cls: type) -> object:
    (cb,) = [c for c in trainer.callbacks if isinstance(c, cls)]
    return cb


def test_a_reordered_callback_list_resumes_each_monitors_history(tmp_path, monkeypatch):
    """Stopped at step 4 with [throughput, loss, memory] and resumed with the list reversed: the
    throughput monitor counts all 8 steps, with the uninterrupted run's token and sequence counts,
    and the memory monitor carries the peak the checkpoint saved."""
    monkeypatch.setitem(monitors.REGISTRY, "stop_at_4", StopAt4)
    data = make_prepared(tmp_path / "data")

    def run(name: str, names: list[str], resume: str | None = None) -> tuple[Trainer, dict]:
        reset_accelerate()
        cfg = tiny_config(tmp_path / name, max_steps=8, export=False, callbacks=names, resume=resume)
        trainer = Trainer(cfg, data)
        return trainer, trainer.run()

    whole, whole_summary = run("whole", ["throughput", "loss", "memory"])
    _, stopped = run("split", ["throughput", "loss", "memory", "stop_at_4"])
    assert stopped["status"] == "stopped" and stopped["steps"] == 4
    saved = json.loads((tmp_path / "split" / "checkpoints" / "step_00000004" / "loop_state.json").read_text())
    assert set(saved["callbacks"]) == {"throughput", "loss", "memory", "stop_at_4"}

    resumed, summary = run("split", ["stop_at_4", "memory", "loss", "throughput"], resume="latest")
    assert summary["status"] == "completed" and summary["steps"] == 8
    assert summary["throughput"]["steps_measured"] == whole_summary["throughput"]["steps_measured"] == 8 - 2
    ours, theirs = _one(resumed, ThroughputMonitor), _one(whole, ThroughputMonitor)
    assert (ours.tokens, ours.seqs, ours.flops) == (theirs.tokens, theirs.seqs, theirs.flops)
    assert len(ours.times) == 8
    peak = saved["callbacks"]["memory"]["peak_bytes"]
    assert peak > 0 and _one(resumed, MemoryMonitor).earlier_peak == peak
    assert summary["memory"]["peak_bytes"] >= peak
