"""The 4-D SDPA padding mask bert_mp builds itself (so transformers never asks ``mask.all()``) gives
exactly the numbers of the 2-D mask transformers would expand."""

from __future__ import annotations

import pytest
import torch
from transformers import BertForPreTraining

from bert_mp.core.config import ModelConfig
from bert_mp.model.bert import bert_config, sdpa_padding_mask
from bert_mp.sweep.diagnostics import synthetic_batch


def _hidden_and_grads(model, batch, mask):
    model.zero_grad(set_to_none=True)
    out = model.bert(batch["input_ids"], attention_mask=mask, token_type_ids=batch["token_type_ids"])
    out.last_hidden_state.square().sum().backward()
    return out.last_hidden_state.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_4d_mask_is_bit_identical_to_the_2d_mask(impl):
    torch.manual_seed(0)
    cfg = ModelConfig(preset="tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForPreTraining(bert_config(cfg, 300))
    model.set_attn_implementation(impl)
    batch = synthetic_batch(300, 6, 24, torch.device("cpu"))
    mask2d = batch["attention_mask"]
    assert not bool(mask2d.all())  # padded rows
    mask = sdpa_padding_mask(mask2d, impl)
    assert mask.shape == ((6, 1, 24, 24) if impl == "sdpa" else (6, 24))
    h2, g2 = _hidden_and_grads(model, batch, mask2d)
    h4, g4 = _hidden_and_grads(model, batch, mask)
    assert torch.equal(h2, h4) and all(torch.equal(a, b) for a, b in zip(g2, g4))


def test_no_mask_and_4d_masks_pass_through():
    full = torch.ones(2, 5, dtype=torch.long)
    assert sdpa_padding_mask(None, "sdpa") is None
    m4 = sdpa_padding_mask(full, "sdpa")
    assert m4.dtype == torch.bool and bool(m4.all()) and sdpa_padding_mask(m4, "sdpa") is m4
