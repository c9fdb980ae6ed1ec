"""The engine adapter both loops call: backward, the accumulation boundary, the clipped norm."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from bert_mp.core.engine import gradients


class FakeAccelerator:
    """Records what the adapter asks of Accelerate; ``deepspeed`` switches the engine."""

    def __init__(self, deepspeed: bool = False, norm=None):
        self.calls: list[object] = []
        self.state = SimpleNamespace(deepspeed_plugin=object() if deepspeed else None)
        self.gradient_state = SimpleNamespace(_set_sync_gradients=lambda v: self.calls.append(("sync", v)))
        self.norm = norm
        engine = SimpleNamespace(get_global_grad_norm=lambda: 2.5)
        self.deepspeed_engine_wrapped = SimpleNamespace(engine=engine) if deepspeed else None

    def backward(self, loss, **kwargs):
        self.calls.append(("backward", kwargs))

    @contextlib.contextmanager
    def no_sync(self, model):
        self.calls.append("no_sync")
        yield

    def clip_grad_norm_(self, parameters, max_norm):
        self.calls.append(("clip", max_norm))
        return self.norm


def test_the_loss_is_not_divided_again_under_deepspeed_and_passed_as_is_elsewhere():
    plain, ds = FakeAccelerator(), FakeAccelerator(deepspeed=True)
    gradients.backward(plain, torch.tensor(1.0))
    gradients.backward(ds, torch.tensor(1.0))
    assert plain.calls == [("backward", {})]
    assert ds.calls == [("backward", {"scale_wrt_gas": False})]


def test_only_the_last_micro_batch_synchronises_and_ends_the_step():
    acc = FakeAccelerator()
    for last in (False, True):
        with gradients.micro_batch(acc, model=None, last=last):
            acc.calls.append("forward")
    assert acc.calls == [("sync", False), "no_sync", "forward", ("sync", True), "forward"]


def test_the_norm_comes_from_the_engine_where_it_clips_itself_and_zero_means_measure_only():
    acc = FakeAccelerator(norm=torch.tensor(3.0))
    assert float(gradients.clip_grad_norm(acc, [], 0.0)) == 3.0
    assert acc.calls == [("clip", float("inf"))]
    ds = FakeAccelerator(deepspeed=True, norm=None)  # DeepSpeed clipped inside its step
    assert gradients.clip_grad_norm(ds, [], 1.0) == 2.5
    assert gradients.clip_grad_norm(FakeAccelerator(norm=None), [], 1.0) is None
