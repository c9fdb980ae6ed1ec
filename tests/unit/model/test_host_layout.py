"""The unpadded layout computed by the collator (model.unpad): the same batches plus ``unpad_layout``,
and the same losses and gradients as the layout the model computes itself."""

from __future__ import annotations

import copy

import pytest
import torch
from support import make_tokenizer, tiny_unpadded_model

from bert_mp.core.config import DataConfig
from bert_mp.data.masking import PretrainingCollator
from bert_mp.model.bert import PretrainingModel
from bert_mp.model.unpad import LAYOUT_KEYS, HostLayout, collate_layout, token_bucket, unpad_index

MAX_LEN = 64


def _features(lengths: list[int], seed: int = 0) -> list[dict]:
    """``[CLS] A [SEP] B [SEP]`` pairs over the fixture vocabulary (ids 5..63), with NSP labels."""
    g = torch.Generator().manual_seed(seed)
    tok = make_tokenizer()
    feats = []
    for i, k in enumerate(lengths):
        a = (k - 3) // 2
        body = torch.randint(5, 64, (k - 3,), generator=g).tolist()
        ids = [tok.cls_token_id, *body[:a], tok.sep_token_id, *body[a:], tok.sep_token_id]
        types = [0] * (a + 2) + [1] * (k - a - 2)
        feats.append(
            {"input_ids": ids, "token_type_ids": types, "next_sentence_label": i % 2, "index": i, "epoch": 0}
        )
    return feats


CASES = {
    "rows": dict(lengths=[9, 23, 12, 64, 17, 30, 8, 41], pack=False),
    "full rows": dict(lengths=[MAX_LEN] * 4, pack=False),
    "packed": dict(lengths=[9, 23, 12, 64, 17, 30, 8, 41], pack=True),
}


def _collators(model: PretrainingModel, pack: bool) -> tuple[PretrainingCollator, PretrainingCollator]:
    tok, cfg = make_tokenizer(), DataConfig(max_seq_length=MAX_LEN)
    plain = PretrainingCollator(tok, cfg, seed=3, pack_pairs=pack)
    with_layout = PretrainingCollator(tok, cfg, seed=3, pack_pairs=pack, layout=collate_layout(model))
    return plain, with_layout


def _step(model: PretrainingModel, micro: list[dict]) -> tuple[dict, dict]:
    """Summed outputs and gradients of one accumulated step, normalised as pretrain/step.py does."""
    model.zero_grad()
    n_masked = sum(int((b["labels"] != -100).sum()) for b in micro)
    n_seqs = sum(len(b["next_sentence_label"]) for b in micro)
    sums: dict = {}
    for b in micro:
        o = model(**b)
        (o["mlm_loss_sum"] / n_masked + o["nsp_loss_sum"] / n_seqs).backward()
        sums = {k: sums.get(k, 0) + o[k].detach() for k in o}
    return sums, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_layout_adds_tensors_and_changes_nothing_else():
    model = tiny_unpadded_model(MAX_LEN)
    plain, with_layout = _collators(model, pack=False)
    feats = _features(CASES["rows"]["lengths"])
    a, b = plain(feats), with_layout(feats)
    assert list(b) == [*a, "unpad_layout"]
    for k in a:
        assert torch.equal(a[k], b[k]), k
    layout, u = b["unpad_layout"], unpad_index(a["attention_mask"])
    for n in LAYOUT_KEYS:
        assert torch.equal(layout.tensors[n], getattr(u, n)), n
    # moved and pinned like a tensor, so the batch's device copy (step.py, evaluate.py) takes it along
    moved = layout.to(torch.device("cpu"), non_blocking=True)
    assert isinstance(moved, HostLayout) and moved.tensors.keys() == layout.tensors.keys()
    received = layout.unpadded(bucketed=False)
    assert received.block_len == max(CASES["rows"]["lengths"]) and received.fillers == 0  # from shapes


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("bucketed", [False, True])
def test_collated_layout_gives_the_device_layouts_losses_and_gradients(case: str, bucketed: bool):
    base = tiny_unpadded_model(MAX_LEN)
    if bucketed:  # a compiled run's stream: fillers up to a bucket, the block rounded up to 64
        base.stream_bucket = token_bucket
    other = copy.deepcopy(base)
    plain, with_layout = _collators(base, CASES[case]["pack"])
    lengths = CASES[case]["lengths"]
    feats = [_features(lengths, seed=1), _features(lengths[::-1], seed=2)]
    if bucketed:  # the bucket's sizes: a block of 64 and a stream a multiple of 64 (fillers where short)
        u = with_layout(feats[0])["unpad_layout"].unpadded(bucketed=True)
        assert u.block_len == 64 and (len(u.indices) + u.fillers) % 64 == 0
    sums_d, grads_d = _step(base, [plain(f) for f in feats])
    sums_h, grads_h = _step(other, [with_layout(f) for f in feats])
    assert sums_d.keys() == sums_h.keys() and grads_d.keys() == grads_h.keys() and len(grads_d) > 10
    for k in sums_d:  # the same layout, so the same kernels on the same inputs: equal to the bit
        assert torch.equal(sums_h[k], sums_d[k]), k
    for name in grads_d:
        assert torch.equal(grads_h[name], grads_d[name]), name


def test_a_padded_model_ignores_the_layout():
    unpadded = tiny_unpadded_model(MAX_LEN)
    padded = PretrainingModel(copy.deepcopy(unpadded.model), unpad=False)
    plain, with_layout = _collators(unpadded, pack=False)
    feats = _features(CASES["rows"]["lengths"])
    with torch.no_grad():
        want, got = padded(**plain(feats)), padded(**with_layout(feats))
        for k in want:
            assert torch.equal(got[k], want[k]), k


def test_compiled_model_takes_the_collated_layout_within_its_graph_budget():
    """torch.compile (``eager`` backend: dynamo's capture and guards, which decide the recompiles) of a
    bucketed unpadded model fed batches with the collated layout: the uncompiled model's sums, and no
    more graphs than two stream buckets need (test_unpad.py's budget for the device-computed layout)."""
    import random

    import torch._dynamo
    from torch._dynamo.utils import counters

    from bert_mp.model.unpad import compiled_graphs, prepare_for_compile

    torch._dynamo.reset()
    reference = tiny_unpadded_model(MAX_LEN)
    model = copy.deepcopy(reference)
    for m in (model, reference):
        prepare_for_compile(m, DataConfig(max_seq_length=MAX_LEN, max_predictions_per_seq=8))
    # rows padded to one length (as test_unpad.py's batches): only the stream buckets vary
    cfg = DataConfig(max_seq_length=MAX_LEN)
    with_layout = PretrainingCollator(
        make_tokenizer(), cfg, 3, pad_to_multiple_of=MAX_LEN, layout=collate_layout(model)
    )
    model.compile(backend="eager", dynamic=False)
    before, frames = compiled_graphs(), counters["frames"]["total"]
    rng = random.Random(0)
    for i in range(8):
        batch = with_layout(_features([rng.randint(8, MAX_LEN) for _ in range(2)], seed=i))
        got, want = (
            model(**batch),
            reference(**{k: v for k, v in batch.items() if k != "unpad_layout"}),
        )
        (got["mlm_loss_sum"] + got["nsp_loss_sum"]).backward()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5)
    # capacity 2 x 64 = 128 tokens: buckets of 64 and 128, each one forward graph after the host-side
    # unpadding and one for the loss after it
    assert compiled_graphs() - before <= 4
    # frames: forward, run_unpadded and the two resumed after the host-side parts, plus a recompile of
    # those two for the second bucket; a layout whose token count reached the guards would recompile
    # forward for every new count (and past the cache limit fall back to eager)
    assert counters["frames"]["total"] - frames <= 6


def test_a_dataloader_worker_collates_the_layout():
    """The layout is computed in the DataLoader's worker process and crosses to the trainer with the batch."""
    from torch.utils.data import DataLoader

    model = tiny_unpadded_model(MAX_LEN)
    _, with_layout = _collators(model, pack=True)
    feats = _features(CASES["packed"]["lengths"])
    loader = DataLoader([feats], batch_size=None, collate_fn=with_layout, num_workers=1)
    (batch,) = list(loader)
    want = with_layout(feats)["unpad_layout"].tensors
    assert isinstance(batch["unpad_layout"], HostLayout)
    for n in LAYOUT_KEYS:
        assert torch.equal(batch["unpad_layout"].tensors[n], want[n]), n
