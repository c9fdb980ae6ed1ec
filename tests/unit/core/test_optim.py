"""optim.py: no-decay groups, fused AdamW, schedules."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertForPreTraining

from bert_mp.core.config import TrainConfig
from bert_mp.core.numerics.optimizers import (
    build_optimizer,
    build_scheduler,
    fused_supported,
    lr_lambda,
    param_groups,
)


def _model() -> BertForPreTraining:
    return BertForPreTraining(
        BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
        )
    )


def test_no_decay_groups():
    model = _model()
    decay, no_decay = param_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    decay_names = {names[id(p)] for p in decay["params"]}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert all(not n.endswith("bias") and "LayerNorm" not in n for n in decay_names)
    assert "bert.embeddings.LayerNorm.weight" in no_decay_names
    assert "bert.encoder.layer.0.attention.self.query.bias" in no_decay_names
    assert "bert.encoder.layer.0.attention.self.query.weight" in decay_names
    # tied decoder weight appears once
    n_params = len({id(p) for p in model.parameters()})
    assert len(decay["params"]) + len(no_decay["params"]) == n_params


def test_fused_adamw_on_cpu():
    cpu = torch.device("cpu")
    opt = build_optimizer(_model(), TrainConfig(fused_adamw=True), cpu)
    assert opt.defaults["fused"] is (True if fused_supported(cpu) else None)
    opt = build_optimizer(_model(), TrainConfig(fused_adamw=False), cpu)
    assert not opt.defaults["fused"]


@pytest.mark.parametrize("kind", ["linear", "polynomial", "constant"])
def test_schedules(kind: str):
    cfg = TrainConfig(max_steps=20, warmup_steps=5, lr_schedule=kind, lr_power=2.0, learning_rate=1.0)
    f = lr_lambda(cfg)
    assert [f(s) for s in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert f(5) == pytest.approx(1.0)
    if kind == "linear":
        assert f(10) == pytest.approx(10 / 15) and f(20) == 0.0
    elif kind == "polynomial":
        assert f(10) == pytest.approx((10 / 15) ** 2) and f(20) == 0.0
    else:
        assert f(19) == 1.0
    # the scheduler applies it to every group
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    sched = build_scheduler(opt, cfg)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2)
    for _ in range(7):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(f(7))
