"""dropout.py: the fast dropout keeps the rate and expectation, is exact where it must be (eval,
p = 0, gradients), and swaps into BertForPreTraining without changing keys, eval outputs or export."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import BertForPreTraining

from bert_mp.core.config import ModelConfig
from bert_mp.model import dropout as fd
from bert_mp.model.bert import bert_config

VOCAB = 96


def _model(attn: str = "sdpa") -> BertForPreTraining:
    cfg = ModelConfig(preset="tiny", hidden_size=32, num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    m = BertForPreTraining(bert_config(cfg, vocab_size=VOCAB))
    m.set_attn_implementation(attn)
    return m


def _inputs(n: int = 4, length: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(n, length, dtype=torch.long)
    mask[0, 10:] = 0
    return {"input_ids": torch.randint(5, VOCAB, (n, length), generator=g), "attention_mask": mask}


@pytest.mark.parametrize("p", [0.1, 0.5, 0.03])
def test_keep_rate_and_independence(p):
    torch.manual_seed(0)
    n = 1 << 22
    keep = fd.keep_mask((n,), p)
    assert keep.dtype == torch.bool
    q = fd.effective_p(p)
    assert abs(q - p) <= 1 / 65536
    sd = (q * (1 - q) / n) ** 0.5
    assert abs(keep.float().mean().item() - (1 - q)) < 6 * sd
    # the four elements fed by one 64-bit draw are independent of each other
    lanes = keep.view(-1, 4).float()
    for a in range(4):
        assert abs(lanes[:, a].mean().item() - (1 - q)) < 12 * sd
        for b in range(a + 1, 4):
            joint = (lanes[:, a] * lanes[:, b]).mean().item()
            assert abs(joint - (1 - q) ** 2) < 12 * sd


def test_values_and_gradient():
    torch.manual_seed(0)
    x = torch.randn(64, 300, requires_grad=True)
    y = fd.fast_dropout(x, 0.1)
    kept = y != 0
    scale = 1 / (1 - fd.effective_p(0.1))
    torch.testing.assert_close(y[kept], x[kept] * scale)
    y.sum().backward()
    torch.testing.assert_close(x.grad, kept.float() * scale)
    # identity outside training and at p = 0; all zeros at p = 1
    assert fd.fast_dropout(x, 0.1, training=False) is x
    assert fd.fast_dropout(x, 0.0) is x
    assert not fd.fast_dropout(x, 1.0).any()


def test_same_generator_same_masks():
    torch.manual_seed(7)
    a = fd.keep_mask((1000,), 0.1)
    torch.manual_seed(7)
    b = fd.keep_mask((1000,), 0.1)
    assert torch.equal(a, b)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_install_keeps_keys_and_eval_outputs(attn, tmp_path):
    ref = _model(attn).eval()
    fast = copy.deepcopy(ref)
    swapped = fd.install_fast_dropout(fast)
    assert swapped == sum(type(m) is nn.Dropout for m in ref.modules()) > 0
    assert not any(type(m) is nn.Dropout for m in fast.modules())
    assert fast.config._attn_implementation == f"bert_mp_fast_dropout_{attn}"
    assert fast.state_dict().keys() == ref.state_dict().keys()
    with torch.no_grad():
        torch.testing.assert_close(fast(**_inputs()).prediction_logits, ref(**_inputs()).prediction_logits)
    # the export is a plain model: reloads with torch's dropout and the default attention
    fast.save_pretrained(tmp_path)
    back = BertForPreTraining.from_pretrained(tmp_path)
    assert not any(isinstance(m, fd.FastDropout) for m in back.modules())
    assert not back.config._attn_implementation.startswith("bert_mp")


@pytest.mark.parametrize("base", ["sdpa", "eager"])
def test_training_attention_equals_eager_when_nothing_is_dropped(monkeypatch, base):
    """With every element kept (and a vanishing rate, so no rescaling), the training path - its
    own attention math - equals the dropout-free model: the only difference from torch's dropout
    is which elements are dropped."""
    ref = _model("eager")
    for m in ref.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    fast = _model(base)
    fd.install_fast_dropout(fast)
    monkeypatch.setattr(fd, "keep_mask", lambda shape, p, device=None: torch.ones(shape, dtype=torch.bool))
    monkeypatch.setattr(fd, "effective_p", lambda p: 1e-12 if p else 0.0)
    calls = []
    real = fd._MaskScale.apply
    monkeypatch.setattr(fd._MaskScale, "apply", lambda *a: calls.append(a[0].dim()) or real(*a))
    ref.train()
    fast.train()
    torch.testing.assert_close(
        fast(**_inputs()).prediction_logits, ref(**_inputs()).prediction_logits, rtol=1e-5, atol=1e-5
    )
    layers = fast.config.num_hidden_layers
    assert calls.count(4) == layers  # attention probabilities went through the fast path
    assert calls.count(3) == 1 + 2 * layers  # embeddings + two hidden dropouts per layer


def test_training_drops_attention_probabilities_at_the_rate():
    m = _model("sdpa")
    fd.install_fast_dropout(m)
    m.train()
    seen = []

    real = fd.fast_dropout

    def spy(x, p, training=True):
        y = real(x, p, training)
        if x.dim() == 4:  # attention probabilities (batch, heads, query, key)
            seen.append(((y == 0) & (x != 0)).float().mean().item())
        return y

    fd.fast_dropout = spy
    try:
        torch.manual_seed(0)
        m(**_inputs(n=16, length=64))
    finally:
        fd.fast_dropout = real
    assert len(seen) == m.config.num_hidden_layers
    assert all(abs(s - 0.1) < 0.01 for s in seen)


def test_resolve():
    assert fd.resolve_dropout_impl("auto", torch.device("cpu")) == "fast"
    assert fd.resolve_dropout_impl("auto", torch.device("cuda")) == "torch"
    assert fd.resolve_dropout_impl("auto", torch.device("cpu"), compiled=True) == "torch"  # no graph breaks
    assert fd.resolve_dropout_impl("torch", torch.device("cpu")) == "torch"
