"""data.token_budget's data side: first-fit rows with a carry, the fixed-shape layout, the step order and
its data position (a function of the lengths and (seed, epoch) only)."""

from __future__ import annotations

import numpy as np
import pytest
from support import make_tokenizer

from bert_mp.core.config import Config, DataConfig
from bert_mp.core.loop.state import LoopState
from bert_mp.data.masking import PretrainingCollator
from bert_mp.data.packing import examples_per_row, fill_rows
from bert_mp.errors import ConfigError, DataError
from bert_mp.pretrain.batches import TokenBudgetSampler, epoch_order


def test_fill_rows_takes_the_longest_prefix_that_fits_first_fit():
    # rows of 10 with at most 2 examples each: 6 -> row 0, 5 -> row 1, 4 -> row 0 (full), 5 -> row 1,
    # 3: no row has room or a free slot, so it and everything after it are carried
    assert fill_rows([6, 5, 4, 5, 3, 1], rows=2, length=10, per_row=2) == [[0, 2], [1, 3]]
    assert fill_rows([10, 10, 1], rows=2, length=10, per_row=4) == [[0], [1]]
    assert fill_rows([3, 3, 3, 3, 3], rows=2, length=10, per_row=2) == [[0, 1], [2, 3]]  # slot cap
    assert fill_rows([], rows=3, length=10, per_row=2) == [[], [], []]
    # a prefix is placed as it is placed inside the longer list: the collator repeats the sampler
    assert fill_rows([6, 5, 4, 5], 2, 10, 2) == fill_rows([6, 5, 4, 5, 3, 1], 2, 10, 2)
    with pytest.raises(ValueError, match="more than max_seq_length=10"):
        fill_rows([11], 2, 10, 2)
    assert examples_per_row(32) == 2 and examples_per_row(128) == 4 and examples_per_row(512) == 16


def _features(lengths: list[int]) -> list[dict]:
    tok = make_tokenizer()
    feats = []
    for i, k in enumerate(lengths):
        a = (k - 3) // 2
        body = [5 + (7 * i + j) % 59 for j in range(k - 3)]
        ids = [tok.cls_token_id, *body[:a], tok.sep_token_id, *body[a:], tok.sep_token_id]
        types = [0] * (a + 2) + [1] * (k - a - 2)
        feats.append(
            {"input_ids": ids, "token_type_ids": types, "next_sentence_label": i % 2, "index": i, "epoch": 0}
        )
    return feats


def test_collated_rows_have_one_shape_and_keep_every_example_whole():
    tok = make_tokenizer()
    cfg = DataConfig(max_seq_length=16, token_budget=True)
    collate = PretrainingCollator(tok, cfg, seed=3, budget_rows=3)
    lengths = [9, 7, 16, 5, 6]  # rows: [9, 7], [16], [5, 6] (2 slots a row at 16 tokens)
    b = collate(_features(lengths))
    assert {k: tuple(v.shape) for k, v in b.items()} == {
        "input_ids": (3, 16),
        "token_type_ids": (3, 16),
        "attention_mask": (3, 16),
        "labels": (3, 16),
        "segment_ids": (3, 16),
        "position_ids": (3, 16),
        "cls_index": (6,),  # 3 rows x 2 NSP slots
        "cu_seqlens": (3 * 2 + 3 + 1,),  # every example and padded tail, then empty sequences
        "next_sentence_label": (6,),
    }
    assert b["segment_ids"].tolist()[0] == [1] * 9 + [2] * 7
    assert b["position_ids"].tolist()[2] == [*range(5), *range(6), 0, 0, 0, 0, 0]
    ids = b["input_ids"].reshape(-1)
    assert (ids[b["cls_index"][:5]] == tok.cls_token_id).all()  # each example's [CLS], in row order
    assert b["next_sentence_label"].tolist() == [0, 1, 0, 1, 0, -100]  # the filler slot: no label
    assert b["cu_seqlens"].tolist() == [0, 9, 16, 32, 37, 43, 48] + [48] * 3
    assert int(b["attention_mask"].sum()) == sum(lengths)
    # the same examples in another micro-batch of the same rows: the same masked tokens
    again = collate(_features(lengths))
    assert all(bool((again[k] == b[k]).all()) for k in b)
    with pytest.raises(ValueError, match="do not fit 3 rows of 16"):
        collate(_features([16, 16, 16, 2]))


def test_token_budget_refuses_what_it_cannot_run_in_one_line():
    for key, value, where in [
        ("unpad", True, "model"),
        ("pack_pairs", True, "data"),
        ("attn_implementation", "flex_attention", "model"),
    ]:
        cfg = Config()
        cfg.data.token_budget = True
        cfg.model.unpad = key == "pack_pairs"  # pack_pairs alone would need unpad first
        setattr(getattr(cfg, where), key, value)
        with pytest.raises(ConfigError, match=r"^data\.token_budget: ") as e:
            cfg.validate()
        assert "\n" not in str(e.value)
    assert DataConfig(token_budget=True).cache_key() == DataConfig().cache_key()  # load-time only


LENGTHS = np.array([30, 4, 4, 4, 4, 4, 4, 4, 28, 32, 9, 17, 3, 31, 6, 6, 20, 12, 25, 5] * 3)


def _sampler(start=(0, 0, 0), rank=0, world=1, accumulation=2) -> TokenBudgetSampler:
    return TokenBudgetSampler(LENGTHS, 2, 32, accumulation, rank, world, seed=7, start=start)


def _steps(sampler: TokenBudgetSampler, n: int) -> list[tuple[list, tuple]]:
    """``n`` steps: (the step's micro-batches, the data position the loop records after it)."""
    it, state, out = iter(sampler), LoopState(), []
    for _ in range(n):
        micro = [next(it) for _ in range(sampler.accumulation)]
        sampler.advance(state)
        out.append((micro, (state.epoch, state.data_offset, state.batch_in_epoch)))
    return out


def test_budget_micro_batches_carry_the_example_that_does_not_fit_and_drop_none():
    steps = _steps(_sampler(), 12)
    order = epoch_order(len(LENGTHS), 7, 0)
    epoch0 = [k for micro, pos in steps for mb in micro for k in mb if k[0] == 0]
    # epoch 0 is its order, contiguous, each example once; what a step could not take ends it
    assert [i for _, i in epoch0] == order[: len(epoch0)].tolist()
    assert len(LENGTHS) - len(epoch0) < 2 * 2 * 32  # less than one step of rows is dropped
    sizes = [len(mb) for micro, _ in steps for mb in micro]
    assert min(sizes) <= 2 < 4 <= max(sizes)  # one example a row up to two a row: one shape for all
    for micro, _ in steps:
        for mb in micro:
            lens = LENGTHS[[i for _, i in mb]].tolist()
            assert sum(len(r) for r in fill_rows(lens, 2, 32, 2)) == len(mb)  # every example fits
    first_epoch1 = next(i for i, (_, pos) in enumerate(steps) if pos[0] == 1)
    assert steps[first_epoch1][1][2] == 1 and steps[first_epoch1 - 1][1][0] == 0


def test_a_resume_at_a_recorded_position_repeats_the_micro_batches_and_ranks_split_a_step():
    straight = _steps(_sampler(), 10)
    for k in (3, 6, 8):  # mid-epoch, and on both sides of the epoch boundary
        resumed = _steps(_sampler(start=straight[k - 1][1]), 10 - k)
        assert resumed == straight[k:]
    # two ranks: the same steps, each rank taking its half, in rank order
    ranks = [_steps(_sampler(rank=r, world=2, accumulation=1), 5) for r in (0, 1)]
    both = _steps(_sampler(accumulation=2), 5)
    assert [a[0] + b[0] for a, b in zip(*ranks)] == [m for m, _ in both]
    assert [a[1] for a in ranks[0]] == [a[1] for a in ranks[1]] == [p for _, p in both]


def test_a_split_too_small_for_one_step_is_one_line():
    with pytest.raises(DataError, match="cannot fill one step"):
        next(iter(TokenBudgetSampler(np.array([32, 32]), 2, 32, 2, 0, 1, seed=1, start=(0, 0, 0))))
    with pytest.raises(DataError, match="more than data.max_seq_length=32"):
        TokenBudgetSampler(np.array([33]), 2, 32, 1, 0, 1, seed=1, start=(0, 0, 0))
