"""data.pack_pairs: several NSP pairs share a row; each gives the losses it gives alone (fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import make_tokenizer, run_unpadded_batch, tiny_unpadded_model

from bert_mp.core.config import Config, DataConfig, ModelConfig
from bert_mp.data.masking import PretrainingCollator
from bert_mp.data.packing import pack_rows
from bert_mp.errors import ConfigError
from bert_mp.model.bert import PretrainingModel
from bert_mp.model.unpad import unpad_index
from bert_mp.pretrain.monitors import attention_flops_tokens

MAX_LEN = 64


def _features(lengths: list[int], seed: int = 0) -> list[dict]:
    """``[CLS] A [SEP] B [SEP]`` pairs over the fixture vocabulary (ids 5..63), with NSP labels."""
    g = torch.Generator().manual_seed(seed)
    tok = make_tokenizer()
    cls, sep = tok.cls_token_id, tok.sep_token_id
    feats = []
    for i, k in enumerate(lengths):
        a = (k - 3) // 2
        body = torch.randint(5, 64, (k - 3,), generator=g).tolist()
        ids = [cls, *body[:a], sep, *body[a:], sep]
        types = [0] * (a + 2) + [1] * (k - a - 2)
        feats.append(
            {"input_ids": ids, "token_type_ids": types, "next_sentence_label": i % 2, "index": i, "epoch": 0}
        )
    return feats


def _model() -> PretrainingModel:
    return tiny_unpadded_model(MAX_LEN)


def _per_pair(model: PretrainingModel, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence MLM loss sum and NSP loss, in the order the model reads the sequences."""
    seq, pooled, labels = run_unpadded_batch(model, batch)
    u = unpad_index(batch["attention_mask"], batch.get("segment_ids"))
    seq_of = torch.arange(u.num_sequences).repeat_interleave(u.lengths)
    heads = model.model.cls
    token_loss = F.cross_entropy(heads.predictions(seq), labels, reduction="none", ignore_index=-100)
    mlm = torch.zeros(u.num_sequences).index_add(0, seq_of, token_loss)
    nsp = F.cross_entropy(heads.seq_relationship(pooled), batch["next_sentence_label"], reduction="none")
    return mlm, nsp


def test_pack_rows_first_fit_in_order():
    assert pack_rows([30, 40, 20, 10, 64], 64) == [[0, 2, 3], [1], [4]]
    assert pack_rows([], 64) == []
    with pytest.raises(ValueError, match="more than max_seq_length"):
        pack_rows([65], 64)


def test_packed_batch_gives_each_pair_its_unpacked_losses():
    lengths = [9, 23, 12, 64, 17, 30, 8, 41]
    feats = _features(lengths)
    data_cfg = DataConfig(max_seq_length=MAX_LEN)
    tok = make_tokenizer()
    plain = PretrainingCollator(tok, data_cfg, seed=3)(feats)
    packed = PretrainingCollator(tok, data_cfg, seed=3, pack_pairs=True)(feats)
    assert packed["input_ids"].shape[0] < plain["input_ids"].shape[0]  # fewer rows
    order = [i for row in pack_rows(lengths, MAX_LEN) for i in row]
    assert packed["next_sentence_label"].tolist() == [feats[i]["next_sentence_label"] for i in order]
    assert int(packed["attention_mask"].sum()) == sum(lengths)
    # the MFU's attention term counts each pair alone, packed or not
    assert attention_flops_tokens(packed["attention_mask"], packed["segment_ids"]) == sum(
        k * k for k in lengths
    )
    assert attention_flops_tokens(plain["attention_mask"]) == sum(k * k for k in lengths)

    model = _model()
    with torch.no_grad():
        mlm_plain, nsp_plain = _per_pair(model, plain)
        mlm_packed, nsp_packed = _per_pair(model, packed)
        sums_plain, sums_packed = model(**plain), model(**packed)
    torch.testing.assert_close(mlm_packed, mlm_plain[order], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nsp_packed, nsp_plain[order], rtol=1e-5, atol=1e-6)
    for k in sums_plain:
        torch.testing.assert_close(sums_packed[k], sums_plain[k], rtol=1e-5, atol=1e-5)


def test_pack_pairs_needs_unpad_and_leaves_the_cache_key():
    cfg = Config(data=DataConfig(pack_pairs=True), model=ModelConfig(unpad=False))
    with pytest.raises(ConfigError, match="model.unpad=true"):
        cfg.validate()
    Config(data=DataConfig(pack_pairs=True), model=ModelConfig(unpad=True)).validate()
    assert DataConfig(pack_pairs=True).cache_key() == DataConfig().cache_key()
