"""train.compile: batches of varying shape compile a bounded number of graphs, with the uncompiled sums.

torch.compile runs with the ``eager`` backend: dynamo's graph capture and guards, which decide the
recompiles, without inductor's slow CPU code generation.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from support import assert_same_step, make_tokenizer, tiny_unpadded_model

from bert_mp.core.config import DataConfig
from bert_mp.data.masking import PretrainingCollator
from bert_mp.model.bert import PretrainingModel
from bert_mp.model.buckets import (
    allow_recompiles,
    collate_length,
    length_bucket,
    sequence_bucket,
    shape_buckets,
)
from bert_mp.model.unpad import compiled_graphs, pad_sequences, prepare_for_compile, unpad_index

MAX_LEN = 64


@pytest.fixture(autouse=True)
def _keep_recompile_limit():
    """prepare_for_compile raises dynamo's process-wide limit; put it back after each test."""
    import torch._dynamo

    config = torch._dynamo.config
    limits = config.recompile_limit, config.accumulated_recompile_limit
    yield
    config.recompile_limit, config.accumulated_recompile_limit = limits


def test_length_and_sequence_buckets_are_few():
    sizes = {length_bucket(n, 128) for n in range(1, 129)}
    assert sizes == {32, 64, 96, 128}
    assert all(length_bucket(n, 128) >= n for n in range(1, 129))
    assert length_bucket(130, 128) == 130  # longer than the configured maximum: left as it is
    assert {sequence_bucket(n, 8) for n in range(1, 65)} == {8, 16, 32, 64}
    assert collate_length(128, unpad=True)(40) == 128 and collate_length(128, unpad=False)(40) == 64


def test_recompile_limit_covers_every_bucket():
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 8
    assert shape_buckets(128, unpad=False, segments=False) == 4
    assert shape_buckets(128, unpad=True, segments=False) == 8
    assert shape_buckets(128, unpad=True, segments=True) == 8 * 7  # 1, 2, 4, ..., 64 sequences a row
    assert allow_recompiles(DataConfig(max_seq_length=128), unpad=False) == 32 * 4
    blocked = DataConfig(max_seq_length=128, objective="mlm", mlm_document_attention="block")
    assert allow_recompiles(blocked, unpad=True) == torch._dynamo.config.recompile_limit == 32 * 8 * 7
    assert torch._dynamo.config.accumulated_recompile_limit == 8 * 32 * 8 * 7
    assert allow_recompiles(DataConfig(max_seq_length=128), unpad=False) == 32 * 8 * 7  # never lowered


def test_pad_sequences_adds_empty_sequences_with_a_safe_key():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    seg = torch.tensor([[1, 1, 2, 0], [1, 2, 2, 2]])
    u = unpad_index(mask, seg, block_len=4, stream_len=9)
    p = pad_sequences(u, 8)
    assert p.num_sequences == 8 and p.lengths.tolist() == [2, 1, 1, 3, 0, 0, 0, 0]
    assert p.key_mask[4:].reshape(4, -1).tolist() == [[True, False, False, False]] * 4
    slots = p.block_index.tolist()
    assert slots[:7] == u.block_index[:7].tolist() and min(slots[7:]) >= 8 * 4 and len(set(slots)) == 9
    assert p.cls_index.tolist() == [0, 2, 3, 4] + [7] * 4  # fillers' [CLS]: a stream token, no label
    full = pad_sequences(unpad_index(torch.ones(2, 4, dtype=torch.long)), 4)
    assert full.cls_index.tolist() == [0, 4, 7, 7]  # no filler token: the last stream position


def _pairs(n: int, rng: random.Random, longest: int = MAX_LEN) -> list[dict]:
    """``n`` NSP pairs ``[CLS] A [SEP] B [SEP]`` of random lengths up to ``longest`` (ids 5..63)."""
    tok = make_tokenizer()
    feats = []
    for i in range(n):
        k = rng.randint(6, longest)
        a = (k - 3) // 2
        body = [rng.randint(5, 63) for _ in range(k - 3)]
        ids = [tok.cls_token_id, *body[:a], tok.sep_token_id, *body[a:], tok.sep_token_id]
        types = [0] * (a + 2) + [1] * (k - a - 2)
        feats.append(
            {"input_ids": ids, "token_type_ids": types, "next_sentence_label": i % 2, "index": i, "epoch": 0}
        )
    return feats


def _documents(n: int, rng: random.Random) -> list[dict]:
    """``n`` MLM-only rows ``[CLS] doc [SEP] doc [SEP] ...`` with 1 to 6 documents each."""
    tok = make_tokenizer()
    feats = []
    for i in range(n):
        ids = [tok.cls_token_id]
        for _ in range(rng.randint(1, 6)):
            size = rng.randint(2, 9)
            if len(ids) + size + 1 > MAX_LEN:
                break
            ids += [rng.randint(5, 63) for _ in range(size)] + [tok.sep_token_id]
        feats.append({"input_ids": ids, "token_type_ids": [0] * len(ids), "index": i, "epoch": 0})
    return feats


def _check_bounded(
    model: PretrainingModel, reference: PretrainingModel, batches: list[tuple[dict, dict]], most: int
) -> None:
    """Run the compiled ``model`` on each static-shape batch and the uncompiled ``reference`` on the
    same examples as the plain collator pads them: the same sums and gradients; ``most`` new graphs."""
    torch._dynamo.reset()
    model.compile(backend="eager", dynamic=False)
    before = compiled_graphs()
    for static, plain in batches:
        assert_same_step(model, reference, static, plain)
    assert compiled_graphs() - before <= most, compiled_graphs() - before


def _collated(data_cfg: DataConfig, features: list[dict], unpad: bool, **kw) -> tuple[dict, dict]:
    tok = make_tokenizer()
    static = PretrainingCollator(tok, data_cfg, seed=1, **kw)
    static.static_length = collate_length(MAX_LEN, unpad)
    return static(features), PretrainingCollator(tok, data_cfg, seed=1, **kw)(features)


@pytest.mark.parametrize("kind", ["packed_pairs", "blocked_documents"])
def test_compiled_packed_and_blocked_batches_compile_a_bounded_number_of_graphs(kind: str):
    """Packed NSP pairs (a varying number of pairs per row and of rows) and blocked MLM rows (a
    varying number of documents): the collator keeps one row per example at ``max_seq_length``, the
    stream is bucketed and the sequences padded with empty ones, so twelve random batches compile at
    most a few graphs."""
    rng = random.Random(0)
    if kind == "packed_pairs":
        data_cfg = DataConfig(max_seq_length=MAX_LEN)
        batches = [_collated(data_cfg, _pairs(6, rng), True, pack_pairs=True) for _ in range(12)]
        assert len({int(b["input_ids"].shape[0]) for _, b in batches}) > 1  # rows vary unbucketed
        assert {tuple(s["input_ids"].shape) for s, _ in batches} == {(6, MAX_LEN)}  # one row per pair
    else:
        data_cfg = DataConfig(max_seq_length=MAX_LEN, objective="mlm", mlm_document_attention="block")
        batches = [_collated(data_cfg, _documents(4, rng), True) for _ in range(12)]
        sequences = {
            int(unpad_index(b["attention_mask"], b["segment_ids"]).num_sequences) for _, b in batches
        }
        assert len(sequences) > 3
    reference = tiny_unpadded_model(MAX_LEN)
    model = PretrainingModel(copy.deepcopy(reference.model), unpad=True)
    prepare_for_compile(model, data_cfg)
    # stream buckets (<= 8 per capacity) x sequence buckets (rows x 1, 2, 4, 8), a graph before and
    # after the host-side unpadding; the batches here reach a few of them
    _check_bounded(model, reference, batches, most=8)


def test_compiled_padded_model_compiles_a_bounded_number_of_graphs():
    """The padded path: batches of 8 to 64 tokens pad to one of four lengths and the masked tokens
    gather into a fixed buffer: at most one graph per length (forward and loss in one)."""
    rng = random.Random(1)
    data_cfg = DataConfig(max_seq_length=MAX_LEN)
    batches = [_collated(data_cfg, _pairs(4, rng, rng.randint(8, MAX_LEN)), False) for _ in range(12)]
    assert len({int(b["input_ids"].shape[1]) for _, b in batches}) > 4  # lengths vary unbucketed
    reference = PretrainingModel(copy.deepcopy(tiny_unpadded_model(MAX_LEN).model))
    reference.model.set_attn_implementation("sdpa")
    model = PretrainingModel(copy.deepcopy(reference.model))
    prepare_for_compile(model, data_cfg)
    _check_bounded(model, reference, batches, most=4)
