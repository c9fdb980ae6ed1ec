"""The one set-up sequence both loops run: its order, and the product's pieces called in it."""

from __future__ import annotations

from types import SimpleNamespace

import accelerate.utils

from bert_mp.core.loop import setup
from bert_mp.core.loop.skeleton import TrainingLoop


class RecordingLoop(TrainingLoop):
    """A product whose pieces only record that they were called."""

    command = "fake"
    warmup_key = "warmup_steps"

    def __init__(self, calls: list[str]):
        section = SimpleNamespace(output_dir="run", SECTION="fake", seed=7, log_with=["x"])
        super().__init__(
            SimpleNamespace(hardware=SimpleNamespace(allow_emulated=False, flush_denormal=True)), section
        )
        self.calls, self.total_steps = calls, 3

    def _piece(self, name: str, result=None):
        self.calls.append(name)
        return result

    def check_inputs(self):
        self._piece("check_inputs")

    def batch_geometry(self, processes):
        return self._piece(f"batch_geometry({processes})", SimpleNamespace(accumulation=2))

    def load_data(self):
        self._piece("load_data")

    def build_model(self):
        return self._piece("build_model", "model")

    def wrap_model(self, model):
        return self._piece(f"wrap_model({model})", "wrapped")

    def build_scheduler(self, optimizer):
        return self._piece(f"build_scheduler({optimizer})", "scheduler")

    def configure_engine(self):
        self._piece("configure_engine")

    def prepare(self, model, optimizer):
        return self._piece(f"prepare({model}, {optimizer})", ("prepared", "prepared optimizer"))

    def checkpointed(self):
        return self._piece("checkpointed", ("best",))

    def build_callbacks(self):
        return self._piece("build_callbacks", ["callback"])

    def train_step(self):
        raise AssertionError("not run")

    hessian_loss = complete = summary_extras = train_step


def test_the_set_up_sequence_runs_its_steps_in_order_with_the_products_pieces(monkeypatch):
    calls: list[str] = []

    def rec(name, result=None):
        def f(*args, **kwargs):
            calls.append(name)
            return result

        return f

    acc = SimpleNamespace(
        num_processes=2,
        process_index=1,
        device="cpu",
        register_for_checkpointing=lambda *objs: calls.append(f"register{objs}"),
    )
    plan = SimpleNamespace(prepare_model=lambda m: calls.append("prepare_model") or f"{m}+storage")
    monkeypatch.setattr(setup, "resolve_plan", rec("resolve_plan", plan))
    monkeypatch.setattr(setup, "apply_flush_denormal", rec("flush_denormal"))
    monkeypatch.setattr(setup, "build_accelerator", rec("build_accelerator", acc))
    monkeypatch.setattr(
        setup, "resolve_strategy", rec("resolve_strategy", SimpleNamespace(label=lambda: "single"))
    )
    monkeypatch.setattr(setup, "announce_start", rec("announce_start", "conditions"))
    monkeypatch.setattr(setup, "RunLog", rec("run_log", "log"))
    monkeypatch.setattr(accelerate.utils, "set_seed", lambda seed: calls.append(f"set_seed({seed})"))
    monkeypatch.setattr(setup, "shard", lambda strategy, model: calls.append("shard") or model)
    monkeypatch.setattr(setup, "build_optimizer", rec("build_optimizer", "optimizer"))
    monkeypatch.setattr(setup, "install_scaler", rec("install_scaler", "scaler"))
    monkeypatch.setattr(setup.HessianEstimator, "for_optimizer", rec("hessian"))
    monkeypatch.setattr(setup, "Checkpointer", rec("checkpointer", "checkpointer"))
    monkeypatch.setattr(setup.NumericsGuard, "for_loop", rec("guard", "guard"))

    loop = RecordingLoop(calls)
    loop.set_up()
    assert calls == [
        "check_inputs",
        "resolve_plan",
        "flush_denormal",
        "build_accelerator",
        "batch_geometry(2)",
        "resolve_strategy",
        "announce_start",
        "load_data",
        "run_log",
        "set_seed(7)",
        "build_model",
        "prepare_model",
        "wrap_model(model+storage)",
        "shard",
        "build_optimizer",
        "build_scheduler(optimizer)",
        "install_scaler",
        "configure_engine",
        "prepare(wrapped, optimizer)",
        "hessian",
        "checkpointed",
        "register('scheduler', 'best')",
        "set_seed(8)",
        "build_callbacks",
        "checkpointer",
        "guard",
    ]
    assert (loop.model, loop.optimizer, loop.callbacks) == ("prepared", "prepared optimizer", ["callback"])
    assert (loop.log, loop.checkpointer, loop.guard, loop.scaler) == (
        "log",
        "checkpointer",
        "guard",
        "scaler",
    )
