"""model.unpad: the unpadded encoder gives the padded path's per-example losses and gradients (fp32)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForPreTraining

from bert_mp.model.bert import PretrainingModel
from bert_mp.model.unpad import run_unpadded, token_bucket, unpad_index

VOCAB, LENGTH = 96, 32


def _model(attn: str = "sdpa", seed: int = 0) -> BertForPreTraining:
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForPreTraining(cfg)
    model.set_attn_implementation(attn)
    return model


def _batch(lengths: list[int], seed: int = 0, nsp: bool = True) -> dict[str, torch.Tensor]:
    """Rows ``[CLS] a.. [SEP] b.. [SEP]`` of the given real lengths, padded to LENGTH."""
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    ids = torch.zeros(n, LENGTH, dtype=torch.long)
    types = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for r, k in enumerate(lengths):
        ids[r, :k] = torch.randint(5, VOCAB, (k,), generator=g)
        ids[r, 0], ids[r, k - 1] = 2, 3
        types[r, k // 2 : k] = 1
        mask[r, :k] = 1
        pick = torch.rand(k, generator=g) < 0.2
        pick[1] = True
        labels[r, :k][pick] = torch.randint(5, VOCAB, (int(pick.sum()),), generator=g)
    batch = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask, "labels": labels}
    if nsp:
        batch["next_sentence_label"] = torch.randint(0, 2, (n,), generator=g)
    return batch


def _per_example(
    wrapper: PretrainingModel, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example MLM loss (mean over its masked tokens) and NSP loss, from the wrapper's encoder path."""
    bert, heads = wrapper.model.bert, wrapper.model.cls
    if wrapper.unpad:
        seq, pooled, flat_labels = run_unpadded(
            wrapper, batch["input_ids"], batch["token_type_ids"], batch["labels"], batch["attention_mask"]
        )
        row_of = torch.arange(LENGTH * len(pooled)).div(LENGTH, rounding_mode="floor")
        row_of = row_of[batch["attention_mask"].reshape(-1) == 1]
        seq, flat_labels = seq[: len(row_of)], flat_labels[: len(row_of)]  # fillers (bucketed) last
    else:
        out = bert(
            batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=batch["token_type_ids"]
        )
        seq, pooled = out.last_hidden_state.reshape(-1, 32), out.pooler_output
        flat_labels = batch["labels"].reshape(-1)
        row_of = torch.arange(flat_labels.numel()).div(LENGTH, rounding_mode="floor")
    token_loss = F.cross_entropy(heads.predictions(seq), flat_labels, reduction="none", ignore_index=-100)
    rows = len(pooled)
    mlm = torch.zeros(rows).index_add(0, row_of, token_loss)
    mlm = mlm / torch.zeros(rows).index_add(0, row_of, (flat_labels != -100).float())
    nsp = F.cross_entropy(
        heads.seq_relationship(pooled),
        batch.get("next_sentence_label", torch.zeros(rows).long()),
        reduction="none",
    )
    return mlm, nsp


SHAPES = {
    "short": [5, 9, 12, 7],
    "full": [LENGTH] * 3,
    "mixed": [LENGTH, 6, 17, LENGTH - 1],
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("attn,bucketed", [("sdpa", False), ("eager", False), ("sdpa", True)])
def test_per_example_losses_match_padded(shape: str, attn: str, bucketed: bool):
    padded = PretrainingModel(_model(attn))
    unpadded = PretrainingModel(_model(attn), unpad=True)
    if bucketed:  # filler tokens up to a stream bucket, attention block rounded to 64
        unpadded.stream_bucket = token_bucket
    batch = _batch(SHAPES[shape])
    with torch.no_grad():
        mlm_p, nsp_p = _per_example(padded, batch)
        mlm_u, nsp_u = _per_example(unpadded, batch)
        sums_p, sums_u = padded(**batch), unpadded(**batch)
    torch.testing.assert_close(mlm_u, mlm_p, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(nsp_u, nsp_p, rtol=1e-5, atol=1e-6)
    for k in sums_p:
        torch.testing.assert_close(sums_u[k], sums_p[k], rtol=1e-5, atol=1e-5)


def _accumulated_grads(
    wrapper: PretrainingModel, micro: list[dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Gradients of one step of accumulated micro-batches, normalised as pretrain/step.py does."""
    wrapper.zero_grad()
    n_masked = sum(int((b["labels"] != -100).sum()) for b in micro)
    n_seqs = sum(len(b["labels"]) for b in micro)
    for b in micro:
        o = wrapper(**b)
        (o["mlm_loss_sum"] / n_masked + o["nsp_loss_sum"] / n_seqs).backward()
    return {n: p.grad.clone() for n, p in wrapper.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("objective", ["nsp", "mlm"])
def test_accumulated_gradients_match_padded(objective: str):
    nsp = objective == "nsp"
    micro = [_batch(SHAPES["short"], seed=1, nsp=nsp), _batch(SHAPES["mixed"], seed=2, nsp=nsp)]
    base = _model()
    padded, unpadded = PretrainingModel(base), PretrainingModel(copy.deepcopy(base), unpad=True)
    gp, gu = _accumulated_grads(padded, micro), _accumulated_grads(unpadded, micro)
    assert gp.keys() == gu.keys() and len(gp) > 10
    for name in gp:
        torch.testing.assert_close(gu[name], gp[name], rtol=1e-4, atol=1e-6, msg=name)


def test_state_dict_keys_unchanged_and_padded_calls_untouched():
    base = _model()
    before = list(base.state_dict())
    wrapper = PretrainingModel(copy.deepcopy(base), unpad=True)
    assert list(wrapper.model.state_dict()) == before
    batch = _batch(SHAPES["mixed"])
    with torch.no_grad():  # the exported model's own (padded) forward is the stock one
        a = base(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).prediction_logits
        b = wrapper.model(
            batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]
        ).prediction_logits
    torch.testing.assert_close(a, b)


def test_unpad_index_layout_and_packed_segments():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    u = unpad_index(mask)
    assert u.lengths.tolist() == [3, 4] and u.cu_seqlens.tolist() == [0, 3, 7]
    assert u.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3] and u.cls_index.tolist() == [0, 3]
    seg = torch.tensor([[1, 1, 2, 0], [1, 2, 2, 2]])
    p = unpad_index(mask, seg, stream_len=9)
    assert p.lengths.tolist() == [2, 1, 1, 3] and p.position_ids.tolist() == [0, 1, 0, 0, 0, 1, 2]
    assert p.fillers == 2 and p.block_len == 3 and len(p.block_index) == 9
    assert len(set(p.block_index.tolist())) == 9  # no two tokens share an attention slot


def test_token_bucket_bounds_the_shapes():
    capacity = 32 * 128
    sizes = {token_bucket(t, capacity) for t in range(1, capacity + 1)}
    assert len(sizes) <= 8 and max(sizes) == capacity
    assert all(token_bucket(t, capacity) >= t for t in range(1, capacity + 1, 37))


def test_compiled_unpadded_model_compiles_a_bounded_number_of_graphs():
    """torch.compile with the ``eager`` backend (dynamo's graph capture and guards, which decide the
    recompiles, without inductor's slow CPU codegen): twelve batches of random row lengths compile the
    graphs of two stream buckets only, and give the uncompiled model's sums."""
    import random

    import torch._dynamo

    from bert_mp.core.config import DataConfig
    from bert_mp.model.unpad import compiled_graphs, prepare_for_compile

    torch._dynamo.reset()
    reference = PretrainingModel(_model(), unpad=True)
    model = PretrainingModel(copy.deepcopy(reference.model), unpad=True)
    prepare_for_compile(model, DataConfig(max_seq_length=LENGTH, max_predictions_per_seq=8))
    prepare_for_compile(reference, DataConfig(max_seq_length=LENGTH, max_predictions_per_seq=8))
    model.compile(backend="eager", dynamic=False)
    before = compiled_graphs()
    rng = random.Random(0)
    for i in range(12):
        batch = _batch([rng.randint(6, LENGTH) for _ in range(4)], seed=i)
        got, want = model(**batch), reference(**batch)
        (got["mlm_loss_sum"] + got["nsp_loss_sum"]).backward()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5)
    # capacity 4 x 32 = 128 tokens: buckets of 64 and 128, each one forward graph after the host-side
    # unpadding and one for the loss after it
    assert compiled_graphs() - before <= 4


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None):
    """torch's ``varlen_attn`` contract on CPU: (T, heads, d) streams, int32 cumulative lengths."""
    assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and int(cu_q[-1]) == q.shape[0]
    assert int((cu_q[1:] - cu_q[:-1]).max()) <= min(max_q, max_k)
    outs = []
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("bucketed", [False, True])
def test_flash_varlen_route_matches_padded(monkeypatch, bucketed: bool):
    """The CUDA flash route (no block, no scatter) gives the padded losses and gradients: its plumbing
    (stream layout, cu_seqlens, output order) checked on CPU with a reference kernel. A bucketed
    (compiled) stream keeps the block route."""
    import bert_mp.model.unpad as unpad_mod

    calls, seen = [], []

    def recording(q, k, v, cu_q, *rest, **kw):
        seen.append(cu_q)
        return _reference_varlen(q, k, v, cu_q, *rest, **kw)

    def kernel(query, dropout, base):
        calls.append(base)
        return recording if base == "sdpa" and not dropout else None

    monkeypatch.setattr(unpad_mod, "flash_varlen_kernel", kernel)
    micro = [_batch(SHAPES["short"], seed=1), _batch(SHAPES["mixed"], seed=2)]
    base = _model()
    padded, unpadded = PretrainingModel(base), PretrainingModel(copy.deepcopy(base), unpad=True)
    if bucketed:
        unpadded.stream_bucket = token_bucket
    gp, gu = _accumulated_grads(padded, micro), _accumulated_grads(unpadded, micro)
    assert calls == ([] if bucketed else ["sdpa"] * len(calls)) and (bucketed or calls)
    if not bucketed:  # every layer of a forward reads the one int32 copy of its layout's cu_seqlens
        assert len(seen) > len(micro) and len({id(c) for c in seen}) == len(micro)
    for name in gp:
        torch.testing.assert_close(gu[name], gp[name], rtol=1e-4, atol=1e-6, msg=name)


def test_flash_varlen_kernel_applies_only_where_it_can():
    from bert_mp.model.unpad import flash_varlen_kernel

    q = torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16)
    assert flash_varlen_kernel(q, 0.0, "sdpa") is None  # CPU: the block path
