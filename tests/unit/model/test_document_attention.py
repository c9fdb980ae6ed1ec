"""data.mlm_document_attention: with ``block`` a token of an MLM-only row attends only within its own
document; with ``cross`` (the default) across the [SEP] between documents (fp32, CPU, dropout off)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support import make_tokenizer, run_unpadded_batch, tiny_unpadded_model

from bert_mp.core.config import Config, DataConfig, ModelConfig
from bert_mp.data.masking import PretrainingCollator
from bert_mp.data.packing import document_segments, pack_documents
from bert_mp.errors import ConfigError
from bert_mp.model.bert import PretrainingModel

MAX_LEN = 64


def _doc(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(5, 64, size=n).tolist()


def _features(rows: list[list[int]]) -> list[dict]:
    """Statically labelled (no MLM targets) MLM-only features, as ``prepare`` writes them."""
    return [
        {"input_ids": r, "token_type_ids": [0] * len(r), "labels": [-100] * len(r), "index": i, "epoch": 0}
        for i, r in enumerate(rows)
    ]


def _row(docs: list[list[int]]) -> list[int]:
    """One ``[CLS] doc [SEP] doc ... [SEP]`` row as ``prepare`` packs it (objective=mlm)."""
    tok = make_tokenizer()
    flat = np.array([t for d in docs for t in d], dtype=np.int32)
    ids, offsets = pack_documents(
        flat, np.array([len(d) for d in docs]), MAX_LEN, tok.cls_token_id, tok.sep_token_id
    )
    assert len(offsets) == 2, "the documents must fill exactly one row"
    return ids.tolist()


def _logits(model: PretrainingModel, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """MLM logits of every real token in stream order, and the stream's start of each row."""
    seq, _, _ = run_unpadded_batch(model, batch)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), batch["attention_mask"].sum(1).cumsum(0)])
    return model.model.cls.predictions(seq), starts


def _model() -> PretrainingModel:
    return tiny_unpadded_model(MAX_LEN).eval()


def test_document_segments_follow_the_separators():
    sep = 3
    ids = np.array([[2, 5, 6, 3, 7, 8, 3, 0], [2, 5, 3, 3, 0, 0, 0, 0], [2, 5, 3, 2, 6, 3, 7, 3]])
    mask = (ids != 0).astype(np.int64)
    packed = np.array([[1] * 8, [1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 2, 2, 2, 2, 2]])
    assert document_segments(ids, mask, sep).tolist() == [
        [1, 1, 1, 1, 2, 2, 2, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],  # a document ending right before the row's [SEP]: no lone [SEP]
        [1, 1, 1, 2, 2, 2, 3, 3],
    ]
    # rows of data.pack_pairs: a new example starts a new segment too
    assert document_segments(ids, mask, sep, packed)[2].tolist() == [1, 1, 1, 2, 2, 2, 3, 3]


def test_blocked_documents_do_not_see_each_other():
    doc_a, doc_b, doc_c = _doc(20, 1), _doc(30, 2), _doc(17, 3)  # doc_c: other tokens, other length
    rows = [_row([doc_a, doc_b]), _row([doc_a, doc_c]), [*doc_b, make_tokenizer().sep_token_id]]
    tok = make_tokenizer()
    model = _model()
    out = {}
    for mode in ("cross", "block"):
        data_cfg = DataConfig(
            objective="mlm", masking="static", max_seq_length=MAX_LEN, mlm_document_attention=mode
        )
        batch = PretrainingCollator(tok, data_cfg, seed=0)(_features(rows))
        assert ("segment_ids" in batch) == (mode == "block")
        with torch.no_grad():
            out[mode] = _logits(model, batch)
            sums = model(**batch)
        assert sums["nsp_count"] == 0 and torch.isfinite(sums["mlm_loss_sum"])
    a = len(doc_a) + 2  # [CLS] doc_a [SEP]
    for mode, close in (("block", True), ("cross", False)):
        logits, starts = out[mode]
        first, second = logits[starts[0] : starts[0] + a], logits[starts[1] : starts[1] + a]
        if close:  # doc_a's outputs do not depend on the document that follows it in its row
            torch.testing.assert_close(first, second, rtol=1e-5, atol=1e-5)
        else:
            assert (first - second).abs().max() > 1e-4  # 10x the tolerance above
    # a blocked document computes what it computes alone in a row (its positions restart at 0)
    logits, starts = out["block"]
    torch.testing.assert_close(
        logits[starts[0] + a : starts[1]], logits[starts[2] : starts[3]], rtol=1e-5, atol=1e-5
    )


def test_block_needs_unpad_and_mlm_and_leaves_the_cache_key():
    block = DataConfig(objective="mlm", mlm_document_attention="block")
    with pytest.raises(ConfigError, match="model.unpad=true"):
        Config(data=block, model=ModelConfig(unpad=False)).validate()
    Config(data=block, model=ModelConfig(unpad=True)).validate()
    with pytest.raises(ConfigError, match="data.mlm_document_attention"):
        DataConfig(mlm_document_attention="block").validate()  # objective=nsp
    with pytest.raises(ConfigError, match="data.mlm_document_attention"):
        DataConfig(objective="mlm", mlm_document_attention="sometimes").validate()
    assert block.cache_key() == DataConfig(objective="mlm").cache_key()
