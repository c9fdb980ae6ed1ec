"""model.py: presets, config checks against the data, masked-only MLM loss == HF loss."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import BertForPreTraining

from bert_mp.core.config import ModelConfig
from bert_mp.errors import ConfigError
from bert_mp.model.bert import PRESETS, PretrainingModel, bert_config, build_model, parameter_counts

VOCAB = 96


def _batch(seed: int = 0, n: int = 6, length: int = 24) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, VOCAB, (n, length), generator=g)
    attention_mask = torch.ones(n, length, dtype=torch.long)
    attention_mask[0, 18:] = 0  # some padding
    input_ids[attention_mask == 0] = 0
    token_type_ids = torch.zeros(n, length, dtype=torch.long)
    token_type_ids[:, length // 2 :] = 1
    labels = torch.full((n, length), -100)
    pick = (torch.rand(n, length, generator=g) < 0.2) & (attention_mask == 1)
    pick[:, 1] = True  # at least one masked token per row
    labels[pick] = torch.randint(5, VOCAB, (int(pick.sum()),), generator=g)
    nsp = torch.randint(0, 2, (n,), generator=g)
    return {
        "input_ids": input_ids,
        "token_type_ids": token_type_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "next_sentence_label": nsp,
    }


def _tiny_cfg(**kw) -> ModelConfig:
    base = dict(preset="tiny", hidden_size=32, num_attention_heads=2, intermediate_size=64)
    base.update(kw)
    return ModelConfig(**base)


def test_presets_and_overrides():
    c = bert_config(ModelConfig(preset="mini"), vocab_size=30528)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.intermediate_size) == (
        256,
        4,
        4,
        1024,
    )
    assert c.vocab_size == 30528
    c = bert_config(ModelConfig(preset="base", num_hidden_layers=3, vocab_size=1000), vocab_size=30528)
    assert (c.hidden_size, c.num_hidden_layers, c.vocab_size) == (768, 3, 1000)
    assert set(PRESETS) >= {"tiny", "mini", "small", "medium", "base", "large"}
    with pytest.raises(ConfigError, match="divisible"):
        bert_config(ModelConfig(preset="tiny", hidden_size=100, num_attention_heads=3), 128)


def test_checks_against_data():
    with pytest.raises(ConfigError, match="smaller than the tokenizer"):
        build_model(_tiny_cfg(), vocab_size=64, tokenizer_size=100, max_seq_length=32)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        build_model(
            _tiny_cfg(max_position_embeddings=16), vocab_size=64, tokenizer_size=60, max_seq_length=32
        )
    with pytest.warns(UserWarning, match="multiple of 8"):
        build_model(_tiny_cfg(), vocab_size=61, tokenizer_size=60, max_seq_length=32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = build_model(_tiny_cfg(), vocab_size=64, tokenizer_size=60, max_seq_length=32)
    assert m.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("sparse", [True, False])
def test_loss_equals_hf_loss(sparse: bool):
    torch.manual_seed(0)
    model = build_model(_tiny_cfg(), vocab_size=VOCAB, tokenizer_size=VOCAB, max_seq_length=32).eval()
    batch = _batch()
    with torch.no_grad():
        ref = model(**batch).loss
        out = PretrainingModel(model, sparse_mlm_head=sparse)(**batch)
    loss = out["mlm_loss_sum"] / out["mlm_count"] + out["nsp_loss_sum"] / out["nsp_count"]
    assert out["mlm_count"] == (batch["labels"] != -100).sum()
    assert out["nsp_count"] == 6
    assert torch.allclose(loss, ref, rtol=1e-6, atol=1e-6), (loss.item(), ref.item())
    with torch.no_grad():
        logits = model(**batch).prediction_logits
    mask = batch["labels"] != -100
    acc = (logits.argmax(-1)[mask] == batch["labels"][mask]).sum()
    assert out["mlm_correct"] == acc


def test_sparse_head_gradients_match_dense():
    torch.manual_seed(0)
    model = build_model(_tiny_cfg(), vocab_size=VOCAB, tokenizer_size=VOCAB, max_seq_length=32).eval()
    batch = _batch(1)
    grads = []
    for sparse in (True, False):
        model.zero_grad()
        out = PretrainingModel(model, sparse)(**batch)
        (out["mlm_loss_sum"] / out["mlm_count"] + out["nsp_loss_sum"] / out["nsp_count"]).backward()
        grads.append(model.cls.predictions.decoder.weight.grad.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_parameter_counts_and_init_from(tmp_path):
    torch.manual_seed(0)
    model = build_model(_tiny_cfg(), vocab_size=VOCAB, tokenizer_size=VOCAB, max_seq_length=32)
    counts = parameter_counts(model)
    # 2 layers x (4 attention 32x32 + 2 ffn 32x64)
    assert counts["encoder_matmul"] == 2 * (4 * 32 * 32 + 2 * 32 * 64)
    assert counts["mlm_decoder_matmul"] == VOCAB * 32
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    model.save_pretrained(tmp_path / "ckpt")
    again = build_model(
        ModelConfig(init_from=str(tmp_path / "ckpt")),
        vocab_size=VOCAB,
        tokenizer_size=VOCAB,
        max_seq_length=32,
    )
    assert isinstance(again, BertForPreTraining)
    assert torch.equal(
        again.bert.embeddings.word_embeddings.weight, model.bert.embeddings.word_embeddings.weight
    )
    with pytest.raises(ConfigError, match="config.json"):
        build_model(
            ModelConfig(init_from=str(tmp_path)), vocab_size=VOCAB, tokenizer_size=VOCAB, max_seq_length=32
        )


def test_mistyped_local_paths_fail_at_once_without_the_hub(tmp_path, monkeypatch):
    from bert_mp.core.config import ModelConfig
    from bert_mp.core.storage.files import looks_like_local_path
    from bert_mp.errors import ConfigError
    from bert_mp.model.bert import check_init_from

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for local in ("runs/trian", "./x", "/no/such", "~/x", "a/b/c", "C:\\models\\x"):
        assert looks_like_local_path(local), local
    for hub in ("bert-base-uncased", "google-bert/bert-base-uncased"):
        assert not looks_like_local_path(hub), hub
    with pytest.raises(ConfigError, match=r"^model\.init_from=runs/trian: no such folder$"):
        check_init_from(ModelConfig(init_from="runs/trian"))
    with pytest.raises(ConfigError, match="no config.json there"):
        check_init_from(ModelConfig(init_from="runs"))
    check_init_from(ModelConfig(init_from=None))
