"""MLM masking: exact counts, 15% share, 80/10/10, specials untouched, determinism, whole words."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import wordpiece_tokenizer

from bert_mp.core.config import DataConfig
from bert_mp.data.masking import (
    MaskingSpec,
    PretrainingCollator,
    derive_rng,
    mask_example,
    mask_sequence,
    num_to_mask,
)

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
UNUSED = [f"[unused{i}]" for i in range(4)]
WORDS = [f"w{i}" for i in range(150)]
PIECES = [f"##p{i}" for i in range(50)]


@pytest.fixture(scope="module")
def tok():
    return wordpiece_tokenizer(SPECIALS + UNUSED + WORDS + PIECES, bert_text=True)


def _spec(tok, **kw) -> MaskingSpec:
    return MaskingSpec.from_tokenizer(tok, DataConfig(**kw))


def _random_pair(rng: np.random.Generator, n_a: int, n_b: int, piece_share: float = 0.0) -> np.ndarray:
    """[CLS] A [SEP] B [SEP] with random word ids (and ## pieces after words when asked)."""
    first_word, first_piece = len(SPECIALS) + len(UNUSED), len(SPECIALS) + len(UNUSED) + len(WORDS)

    def seg(n):
        out = []
        for _ in range(n):
            if out and rng.random() < piece_share:
                out.append(int(rng.integers(first_piece, first_piece + len(PIECES))))
            else:
                out.append(int(rng.integers(first_word, first_piece)))
        return out

    return np.array([2, *seg(n_a), 3, *seg(n_b), 3], dtype=np.int64)


def test_num_to_mask_formula():
    assert num_to_mask(0, 0.15, 20) == 0
    assert num_to_mask(1, 0.15, 20) == 1
    assert num_to_mask(3, 0.15, 20) == 1  # never zero
    assert num_to_mask(100, 0.15, 20) == 15
    assert num_to_mask(1000, 0.15, 20) == 20  # capped
    assert num_to_mask(125, 0.15, 76) == round(125 * 0.15)


def test_spec_classifies_vocabulary(tok):
    spec = _spec(tok)
    regular = set(spec.regular_ids.tolist())
    ids = tok.convert_tokens_to_ids(SPECIALS + UNUSED)
    assert not regular & set(ids)
    assert len(regular) == len(WORDS) + len(PIECES)
    assert spec.special[tok.convert_tokens_to_ids(SPECIALS)].all()
    assert spec.continuation[tok.convert_tokens_to_ids(PIECES)].all()
    assert not spec.continuation[tok.convert_tokens_to_ids(WORDS)].any()


def test_exact_count_specials_untouched_and_never_zero(tok):
    spec = _spec(tok, max_predictions_per_seq=20)
    rng = np.random.default_rng(0)
    for i in range(400):
        ids = _random_pair(rng, int(rng.integers(1, 70)), int(rng.integers(1, 50)))
        masked, labels = mask_example(ids, spec, seed=1, epoch=0, index=i)
        n = len(ids) - 3
        sel = labels != -100
        assert sel.sum() == num_to_mask(n, 0.15, 20) >= 1
        special_pos = spec.special[ids]
        assert (labels[special_pos] == -100).all()
        assert (masked[special_pos] == ids[special_pos]).all()
        assert (labels[sel] == ids[sel]).all()
        assert (masked[~sel] == ids[~sel]).all()


def test_masked_share_and_80_10_10_split(tok):
    spec = _spec(tok, max_predictions_per_seq=512)
    rng = np.random.default_rng(1)
    candidates = selected = as_mask = as_random = unchanged = 0
    while candidates < 40_000:
        ids = _random_pair(rng, int(rng.integers(20, 100)), int(rng.integers(20, 100)))
        masked, labels = mask_sequence(ids, spec, rng)
        sel = labels != -100
        candidates += len(ids) - 3
        selected += sel.sum()
        as_mask += (masked[sel] == spec.mask_token_id).sum()
        unchanged += (masked[sel] == ids[sel]).sum()
        as_random += ((masked[sel] != spec.mask_token_id) & (masked[sel] != ids[sel])).sum()
    assert selected / candidates == pytest.approx(0.15, abs=0.01)
    assert as_mask / selected == pytest.approx(0.8, abs=0.015)
    # a random replacement equal to the original (1 in 200) counts as unchanged
    assert as_random / selected == pytest.approx(0.1, abs=0.012)
    assert unchanged / selected == pytest.approx(0.1, abs=0.012)


def test_random_replacements_are_regular_tokens_only(tok):
    spec = _spec(tok, mask_token_prob=0.0, random_token_prob=1.0, max_predictions_per_seq=512)
    rng = np.random.default_rng(2)
    drawn = set()
    for _ in range(300):
        ids = _random_pair(rng, 60, 60)
        masked, labels = mask_sequence(ids, spec, rng)
        drawn.update(masked[labels != -100].tolist())
    assert drawn <= set(spec.regular_ids.tolist())
    # the draw covers the whole regular vocabulary, not a fixed subset
    assert len(drawn) == len(spec.regular_ids)


def test_masking_is_a_function_of_seed_epoch_index(tok):
    spec = _spec(tok)
    ids = _random_pair(np.random.default_rng(3), 60, 60)
    a = mask_example(ids, spec, seed=7, epoch=2, index=11)
    b = mask_example(ids, spec, seed=7, epoch=2, index=11)
    assert all((x == y).all() for x, y in zip(a, b))
    for other in [(8, 2, 11), (7, 3, 11), (7, 2, 12)]:
        c = mask_example(ids, spec, *other)
        assert not (c[1] == a[1]).all()


def test_derive_rng_ignores_global_state():
    np.random.seed(0)
    a = derive_rng(5, 1, 2, 3).random(4)
    np.random.seed(99)
    np.random.random(10)
    assert (derive_rng(5, 1, 2, 3).random(4) == a).all()
    assert not (derive_rng(5, 2, 2, 3).random(4) == a).all()


def test_whole_word_masking_keeps_words_together(tok):
    spec = _spec(tok, whole_word_masking=True, max_predictions_per_seq=20)
    rng = np.random.default_rng(4)
    exact = 0
    for i in range(300):
        ids = _random_pair(rng, int(rng.integers(5, 60)), int(rng.integers(5, 60)), piece_share=0.4)
        _, labels = mask_example(ids, spec, seed=3, epoch=0, index=i)
        sel = labels != -100
        assert sel.sum() >= 1
        assert not sel[spec.special[ids]].any()
        # a word is [head, ##p, ##p, ...]: masked iff its head is masked
        for p in range(1, len(ids)):
            if spec.continuation[ids[p]] and not spec.special[ids[p - 1]]:
                assert sel[p] == sel[p - 1], (i, p)
        exact += sel.sum() == num_to_mask(len(ids) - 3, 0.15, 20)
    assert exact >= 270  # only overshoot-skips of long words may leave the count short


def test_whole_word_single_long_word_still_masks_something(tok):
    spec = _spec(tok, whole_word_masking=True)
    pieces = tok.convert_tokens_to_ids(["w1", "##p1", "##p2", "##p3"])
    ids = np.array([2, *pieces, 3, *pieces, 3])
    _, labels = mask_example(ids, spec, seed=0, epoch=0, index=0)
    assert (labels != -100).sum() == 4  # one whole word, although the budget is 1


def _features(rng, n):
    out = []
    for i in range(n):
        ids = _random_pair(rng, int(rng.integers(3, 30)), int(rng.integers(3, 30)))
        tt = np.zeros_like(ids)
        tt[list(ids).index(3) + 1 :] = 1
        out.append(
            {
                "input_ids": ids.tolist(),
                "token_type_ids": tt.tolist(),
                "next_sentence_label": i % 2,
                "index": i,
            }
        )
    return out


def test_collator_dynamic_pads_and_masks_independently_of_batching(tok):
    collate = PretrainingCollator(tok, DataConfig(), seed=5)
    feats = [dict(f, epoch=1) for f in _features(np.random.default_rng(5), 12)]
    full = collate(feats)
    assert set(full) == {"input_ids", "token_type_ids", "attention_mask", "labels", "next_sentence_label"}
    assert all(t.dtype == torch.long for t in full.values())
    assert full["input_ids"].shape[1] % 8 == 0
    lengths = torch.tensor([len(f["input_ids"]) for f in feats])
    assert (full["attention_mask"].sum(1) == lengths).all()
    pad = full["attention_mask"] == 0
    assert (full["input_ids"][pad] == tok.pad_token_id).all()
    assert (full["labels"][pad] == -100).all()
    assert ((full["labels"] != -100).sum(1) >= 1).all()
    assert full["next_sentence_label"].tolist() == [i % 2 for i in range(12)]
    # the same example in another batch (other order, other neighbours) gets the same mask
    part = collate(list(reversed(feats[3:7])))
    for row, i in enumerate(reversed(range(3, 7))):
        k = len(feats[i]["input_ids"])
        assert torch.equal(part["input_ids"][row, :k], full["input_ids"][i, :k])
        assert torch.equal(part["labels"][row, :k], full["labels"][i, :k])
    # a new epoch gives a new mask
    again = collate([dict(f, epoch=2) for f in feats])
    assert not torch.equal(again["labels"], full["labels"])


def test_collator_static_only_pads(tok):
    collate = PretrainingCollator(tok, DataConfig(masking="static"), seed=5, pad_to_multiple_of=None)
    feats = _features(np.random.default_rng(6), 4)
    for f in feats:
        f["labels"] = [-100] * len(f["input_ids"])
        f["labels"][1] = f["input_ids"][1]
    out = collate(feats)
    assert out["input_ids"].shape[1] == max(len(f["input_ids"]) for f in feats)
    for row, f in enumerate(feats):
        k = len(f["input_ids"])
        assert out["input_ids"][row, :k].tolist() == f["input_ids"]
        assert out["labels"][row, :k].tolist() == f["labels"]
        assert out["token_type_ids"][row, :k].tolist() == f["token_type_ids"]


def test_collator_dynamic_requires_index_and_epoch(tok):
    collate = PretrainingCollator(tok, DataConfig(), seed=5)
    with pytest.raises(ValueError, match="index"):
        collate(_features(np.random.default_rng(7), 2))


@settings(max_examples=100, deadline=None)
@given(
    body=st.lists(
        st.integers(min_value=0, max_value=len(SPECIALS) + len(UNUSED) + len(WORDS) + len(PIECES) - 1)
    ),
    whole_word=st.booleans(),
    max_predictions=st.integers(min_value=1, max_value=40),
    seed=st.integers(min_value=0, max_value=2**63),
)
def test_properties_on_arbitrary_sequences(tok, body, whole_word, max_predictions, seed):
    """Any ids (specials anywhere, ## first, empty): specials untouched, count bounded, >= 1 if possible."""
    spec = _spec(tok, whole_word_masking=whole_word, max_predictions_per_seq=max_predictions)
    ids = np.array([2, *body, 3], dtype=np.int64)
    masked, labels = mask_example(ids, spec, seed=seed, epoch=0, index=0)
    sel = labels != -100
    n = int((~spec.special[ids]).sum())
    assert not sel[spec.special[ids]].any()
    assert (masked[~sel] == ids[~sel]).all() and (labels[sel] == ids[sel]).all()
    if n == 0:
        assert not sel.any()
    elif whole_word:
        assert sel.sum() >= 1
    else:
        assert sel.sum() == num_to_mask(n, 0.15, max_predictions)
