"""precision=fp8: which Linears convert, an emulated run with a finite loss, plain HF weights out."""

from __future__ import annotations

import json
import math

import pytest
import torch
from support import load_fixture, tiny_config, tiny_model_config
from transformers import BertForPreTraining

import bert_mp.pretrain.trainer as train_mod
from bert_mp.core.numerics.fp8 import convert_fp8, fp8_eligible
from bert_mp.core.storage.files import read_jsonl
from bert_mp.model.bert import bert_config


def _model() -> BertForPreTraining:
    torch.manual_seed(0)
    return BertForPreTraining(bert_config(tiny_model_config(), 64))


def test_the_conversion_rule_keeps_heads_and_odd_dimensions():
    model = _model()
    linear = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    names = {n for n, m in linear.items() if fp8_eligible(n, m)}
    assert "bert.encoder.layer.0.attention.self.query" in names
    assert "bert.encoder.layer.1.output.dense" in names
    assert "cls.predictions.decoder" not in names and "cls.seq_relationship" not in names
    assert "cls.predictions.decoder" in {n for n, m in linear.items() if fp8_eligible(n, m, heads=True)}
    assert not fp8_eligible("x", torch.nn.Linear(32, 2), heads=True)  # NSP's 2 outputs: not a multiple of 16
    assert not fp8_eligible("x", torch.nn.Linear(24, 32))


def test_converted_model_keeps_its_state_dict_keys():
    plain, model = _model(), _model()
    converted = convert_fp8(model, "rowwise", emulate=True)
    assert converted and all(type(model.get_submodule(n)).__name__ == "Float8Linear" for n in converted)
    assert list(model.state_dict()) == list(plain.state_dict())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_emulated_trains_with_finite_loss_and_exports_plain_weights(tmp_path, prepared, recipe):
    run = tmp_path / "run"
    cfg = tiny_config(run, precision="fp8", fp8_recipe=recipe, max_steps=6, export=True)
    summary = train_mod.train(cfg, load_fixture(prepared))
    assert summary["status"] == "completed"
    prec = summary["precision"]
    assert prec["name"] == "fp8" and prec["fp8_recipe"] == recipe
    assert prec["emulated"] and "emulated" in prec["note"]  # no CPU has float8 matmuls
    losses = [r["loss/total"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    loaded = BertForPreTraining.from_pretrained(run / "final")
    assert not [m for m in loaded.modules() if type(m).__name__ == "Float8Linear"]
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    assert json.loads((run / "final" / "config.json").read_text())["dtype"] == "float32"
