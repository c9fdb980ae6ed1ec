"""data.token_budget rows through the model: the padded path's losses and gradients on the same examples
(fp32), by the block-diagonal mask and by the varlen route, with no host read in the step."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from support import assert_same_step, make_tokenizer, tiny_unpadded_model
from sync_double import HostSyncRecorder

import bert_mp.model.rows as rows_mod
from bert_mp.core.config import DataConfig
from bert_mp.data.masking import PretrainingCollator
from bert_mp.data.packing import examples_per_row, fill_rows
from bert_mp.model.bert import PretrainingModel

L, ROWS = 64, 4


def _budget_examples(seed: int) -> list[dict]:
    """NSP pairs, short (6-14 tokens) and long (40-64) mixed, as many as fill ROWS rows of L."""
    rng, tok = random.Random(seed), make_tokenizer()
    feats = []
    for i in range(ROWS * examples_per_row(L)):
        k = rng.choice([rng.randint(6, 14), rng.randint(40, L)])
        a, body = (k - 3) // 2, [rng.randint(5, 63) for _ in range(k - 3)]
        ids = [tok.cls_token_id, *body[:a], tok.sep_token_id, *body[a:], tok.sep_token_id]
        types = [0] * (a + 2) + [1] * (k - a - 2)
        feats.append(
            {"input_ids": ids, "token_type_ids": types, "next_sentence_label": i % 2, "index": i, "epoch": 0}
        )
    placed = fill_rows([len(f["input_ids"]) for f in feats], ROWS, L, examples_per_row(L))
    return feats[: sum(len(r) for r in placed)]


@pytest.fixture(scope="module")
def batches() -> list[tuple[dict, dict]]:
    """(token-budget rows, the same examples padded one a row) for three micro-batches."""
    tok = make_tokenizer()
    rows = PretrainingCollator(tok, DataConfig(max_seq_length=L, token_budget=True), seed=1, budget_rows=ROWS)
    padded = PretrainingCollator(tok, DataConfig(max_seq_length=L), seed=1)
    out = [(rows(f), padded(f)) for f in (_budget_examples(s) for s in range(3))]
    assert {len(p["input_ids"]) for _, p in out} != {ROWS}  # several examples share rows
    return out


def _models(attn: str) -> tuple[PretrainingModel, PretrainingModel]:
    reference = PretrainingModel(copy.deepcopy(tiny_unpadded_model(L).model))
    reference.model.set_attn_implementation(attn)
    return PretrainingModel(copy.deepcopy(reference.model), token_budget=True), reference


def _same_step(model: PretrainingModel, reference: PretrainingModel, batches: list) -> None:
    """Sums and gradients of every micro-batch equal the padded path's (fp32)."""
    for rows, padded in batches:
        assert_same_step(model, reference, rows, padded)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_budget_rows_give_the_padded_losses_and_gradients(batches, attn):
    model, reference = _models(attn)
    _same_step(model, reference, batches)
    assert model.model.config._attn_implementation == f"bert_mp_rows_{attn}"


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None):
    """What torch's varlen kernel computes, per sequence of ``cu_q`` (empty ones included), on a CPU."""
    assert torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32 and int(cu_q[-1]) == q.shape[0]
    bounds = cu_q.tolist()
    assert max(b - a for a, b in zip(bounds, bounds[1:])) <= max_q == max_k
    outs = [
        F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (q, k, v)), scale=scale).transpose(
            0, 1
        )
        for a, b in zip(bounds, bounds[1:])
        if b > a
    ]
    return torch.cat(outs)


def test_the_varlen_route_takes_the_batch_cu_seqlens_and_gives_the_same_step(batches, monkeypatch):
    """Where the varlen kernel applies (CUDA, 16-bit, no attention dropout) the rows are flattened and
    cut by the batch's fixed-size cu_seqlens: a CPU stand-in for the kernel gives the padded step."""
    calls = []

    def kernel(query, dropout, base):
        calls.append((dropout, base))
        return _reference_varlen

    monkeypatch.setattr(rows_mod, "varlen_kernel", kernel)
    model, reference = _models("sdpa")
    _same_step(model, reference, batches)
    assert calls and set(calls) == {(0.0, "sdpa")}  # every layer of every micro-batch took it
    assert rows_mod.rows_route("cpu", True, 0.0, "auto") == "varlen"
    assert rows_mod.rows_route("cpu", True, 0.0, "math") == "block_diagonal"  # a named SDPA kernel wins


def _traceable_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None):
    """The kernel's semantics in tensor ops only (no host read): a token sees its own sequence."""
    seq = torch.searchsorted(cu_q[1:].long(), torch.arange(q.shape[0]), right=True)
    mask = seq[:, None] == seq[None, :]
    out = F.scaled_dot_product_attention(*(x.transpose(0, 1) for x in (q, k, v)), attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def test_the_compiled_varlen_route_is_one_graph_without_a_break(batches, monkeypatch):
    """Compiled (aot_eager: dynamo's capture and guards, AOT autograd's trace), the varlen route and its
    choice trace into one graph for micro-batches of different examples - what CUDA graphs need."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from bert_mp.model.unpad import compiled_graphs

    monkeypatch.setattr(rows_mod, "varlen_kernel", lambda query, dropout, base: _traceable_varlen)
    model, reference = _models("sdpa")
    model.max_predictions_per_seq = DataConfig(max_seq_length=L, token_budget=True).masking_budget()
    torch._dynamo.reset()
    model.compile(backend="aot_eager", dynamic=False)
    before, breaks = compiled_graphs(), sum(counters["graph_break"].values())
    _same_step(model, reference, batches)
    assert compiled_graphs() - before == 1 and sum(counters["graph_break"].values()) == breaks


def test_the_route_on_this_cpu_is_the_block_diagonal_mask():
    # torch's varlen kernel is CUDA-only (torch 2.13's CPU build has no kernel behind the op)
    assert rows_mod.rows_route("cpu", True, 0.0, "auto") == "block_diagonal"
    mask = rows_mod.block_diagonal_mask(torch.tensor([[1, 1, 2, 0]]))
    assert mask[0, 0].int().tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]


def test_a_budget_step_reads_nothing_back_with_the_static_gather(batches):
    """The CUDA set-up (fixed-size masked-token gather): the forward, the loss and the backward of a
    token-budget micro-batch make no host read and no blocking copy (sync double, tests/sync_double.py)."""
    model, _ = _models("sdpa")
    model.max_predictions_per_seq = DataConfig(max_seq_length=L, token_budget=True).masking_budget()
    rows, _ = batches[0]
    with HostSyncRecorder() as rec:
        # moved as the step moves a batch (torch.device: the double's stand-in for an accelerator)
        rows = {k: v.to(torch.device("cpu"), non_blocking=True) for k, v in rows.items()}
        out = model(**rows)
        (out["mlm_loss_sum"] + out["nsp_loss_sum"]).backward()
    assert rec.events == [], rec.report()
    assert float(out["nsp_count"]) == int((rows["next_sentence_label"] != -100).sum())
