"""NSP pairing: layout, fit, positives continue A in the same document, randoms come from another
document, truncation matches the reference loop, label balance stays near 50/50."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bert_mp.data.pairs import NspBalance, PairParams, PairStats, _truncate, block_pairs, build_examples

CLS, SEP = 2, 3


def _below(rng: random.Random, n: int) -> int:
    """Uniform integer in ``[0, n)`` as the pairing loop draws it inline: ``int(random() * n)``."""
    return int(rng.random() * n)


def truncation_amounts(len_a: int, len_b: int, max_num_tokens: int, rng: random.Random) -> tuple[int, ...]:
    """Tokens to drop ``(a_front, a_back, b_front, b_back)`` so that ``len_a + len_b <= max``: the
    pairing loop's truncation, callable on any pair."""
    if len_a + len_b <= max_num_tokens:
        return 0, 0, 0, 0
    return _truncate(len_a, len_b, max_num_tokens, rng.getrandbits)


def pairs_from_token_lists(
    documents,
    max_seq_length: int,
    rng: random.Random,
    short_seq_prob: float = 0.1,
    nsp_random_prob: float = 0.5,
) -> tuple[list[dict], PairStats]:
    """Pairing for small inputs: documents as lists of sentences of token ids -> examples as dicts
    (``input_ids``, ``token_type_ids``, ``next_sentence_label``) and the stats; empty sentences and
    documents are skipped, as prepare skips them."""
    kept = [[list(s) for s in d if len(s)] for d in documents]
    kept = [d for d in kept if d]
    sent_lens = [len(s) for d in kept for s in d]
    sent_bounds = [0, *np.cumsum(sent_lens, dtype=np.int64).tolist()]
    doc_sents = [0, *np.cumsum([len(d) for d in kept], dtype=np.int64).tolist()]
    flat = np.array([t for d in kept for s in d for t in s], dtype=np.int32)
    params = PairParams(max_seq_length - 3, short_seq_prob, nsp_random_prob)
    balance, stats = NspBalance(nsp_random_prob), PairStats()
    pairs = block_pairs(range(len(kept)), sent_bounds, doc_sents, params, rng, balance, stats)
    if not pairs:
        return [], stats
    ids, types, offsets, labels = build_examples(flat, pairs, CLS, SEP)
    examples = [
        {
            "input_ids": ids[offsets[k] : offsets[k + 1]].tolist(),
            "token_type_ids": types[offsets[k] : offsets[k + 1]].tolist(),
            "next_sentence_label": int(labels[k]),
        }
        for k in range(len(pairs))
    ]
    return examples, stats


def _corpus(rng: random.Random, n_docs: int, max_sents: int, max_len: int):
    """Documents whose token ids are unique, so every token tells its document and position."""
    where = {}
    docs = []
    next_id = 10
    for d in range(n_docs):
        doc, pos = [], 0
        for _ in range(rng.randint(1, max_sents)):
            sent = []
            for _ in range(rng.randint(1, max_len)):
                where[next_id] = (d, pos)
                sent.append(next_id)
                next_id += 1
                pos += 1
            doc.append(sent)
        docs.append(doc)
    return docs, where


def _check_examples(examples, where, max_seq_length):
    for ex in examples:
        ids, tt = ex["input_ids"], ex["token_type_ids"]
        assert len(ids) <= max_seq_length
        assert len(ids) == len(tt)
        assert ids[0] == CLS and ids[-1] == SEP
        seps = [i for i, t in enumerate(ids) if t == SEP]
        assert len(seps) == 2
        a, b = ids[1 : seps[0]], ids[seps[0] + 1 : -1]
        assert a and b
        # exactly one A/B boundary: 0 through the first [SEP], 1 after
        assert tt == [0] * (seps[0] + 1) + [1] * (len(ids) - seps[0] - 1)
        for seg in (a, b):
            d0, p0 = where[seg[0]]
            assert [where[t] for t in seg] == [(d0, p0 + k) for k in range(len(seg))]  # contiguous text
        (da, pa_end), (db, pb_start) = where[a[-1]], where[b[0]]
        if ex["next_sentence_label"] == 0:
            assert da == db and pb_start > pa_end  # B continues A in the same document
        else:
            assert da != db  # random B comes from another document


@pytest.mark.parametrize("seed", range(5))
def test_examples_follow_reference_semantics(seed):
    rng = random.Random(seed)
    docs, where = _corpus(rng, n_docs=40, max_sents=12, max_len=25)
    examples, stats = pairs_from_token_lists(docs, max_seq_length=64, rng=random.Random(seed + 100))
    assert stats.pairs == len(examples) > 50
    _check_examples(examples, where, 64)


def test_short_seq_prob_gives_short_targets():
    docs, where = _corpus(random.Random(1), n_docs=60, max_sents=20, max_len=20)
    long_ex, _ = pairs_from_token_lists(docs, 128, random.Random(0), short_seq_prob=0.0)
    short_ex, _ = pairs_from_token_lists(docs, 128, random.Random(0), short_seq_prob=1.0)
    mean = lambda exs: np.mean([len(e["input_ids"]) for e in exs])  # noqa: E731
    assert mean(short_ex) < 0.8 * mean(long_ex)
    _check_examples(short_ex, where, 128)


def test_label_balance_compensates_forced_randoms():
    # Short documents of long sentences: many one-segment chunks force a random B.
    docs, where = _corpus(random.Random(2), n_docs=400, max_sents=3, max_len=60)
    examples, stats = pairs_from_token_lists(docs, 64, random.Random(3))
    share = np.mean([e["next_sentence_label"] for e in examples])
    assert stats.forced_random > 0.2 * stats.pairs  # the skew really is there
    assert 0.47 <= share <= 0.53
    _check_examples(examples, where, 64)


@pytest.mark.parametrize("p", [0.0, 0.3, 0.5])
def test_nsp_random_prob_is_the_target(p):
    docs, _ = _corpus(random.Random(4), n_docs=300, max_sents=15, max_len=15)
    examples, stats = pairs_from_token_lists(docs, 64, random.Random(5), nsp_random_prob=p)
    share = np.mean([e["next_sentence_label"] for e in examples])
    floor = stats.forced_random / stats.pairs  # one-segment chunks are random whatever p is
    assert share == pytest.approx(max(p, floor), abs=0.03)


def test_single_document_cannot_have_random_b_and_says_so():
    docs, where = _corpus(random.Random(6), n_docs=1, max_sents=30, max_len=40)
    examples, stats = pairs_from_token_lists(docs, 64, random.Random(7))
    assert all(e["next_sentence_label"] == 0 for e in examples)
    assert stats.no_other_document + stats.skipped_single_segment > 0
    _check_examples(examples, where, 64)


def test_empty_sentences_and_documents_are_skipped():
    docs = [[], [[], []], [[10, 11], [], [12]], [[20], [21, 22]]]
    examples, stats = pairs_from_token_lists(docs, 16, random.Random(0))
    assert examples
    used = {t for e in examples for t in e["input_ids"]} - {CLS, SEP}
    assert used <= {10, 11, 12, 20, 21, 22}


def _reference_truncation(la: int, lb: int, max_tokens: int) -> tuple[int, int]:
    """Per-side removals of the reference loop (longer side, B on a tie)."""
    ra = rb = 0
    while la + lb > max_tokens:
        if la > lb:
            la, ra = la - 1, ra + 1
        else:
            lb, rb = lb - 1, rb + 1
    return ra, rb


def test_truncation_matches_reference_totals_and_is_fair():
    rng = random.Random(0)
    for la in range(1, 40):
        for lb in range(1, 40):
            for m in (5, 17, 40):
                af, ab, bf, bb = truncation_amounts(la, lb, m, rng)
                assert (af + ab, bf + bb) == _reference_truncation(la, lb, m)
                assert min(af, ab, bf, bb) >= 0 and la - af - ab >= 1 and lb - bf - bb >= 1
    fronts = [truncation_amounts(100, 1, 21, rng)[0] for _ in range(4000)]
    assert np.mean(fronts) == pytest.approx(40, abs=0.5)  # Binomial(80, 1/2)
    assert np.var(fronts) == pytest.approx(20, rel=0.15)


def test_build_examples_layout():
    flat = np.arange(100, 120, dtype=np.int32)
    ids, tt, off, labels = build_examples(flat, [(0, 3, 10, 12, 0), (5, 6, 0, 1, 1)], CLS, SEP)
    assert ids[off[0] : off[1]].tolist() == [CLS, 100, 101, 102, SEP, 110, 111, SEP]
    assert tt[off[0] : off[1]].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert ids[off[1] : off[2]].tolist() == [CLS, 105, SEP, 100, SEP]
    assert labels.tolist() == [0, 1]


def test_balance_prior_starts_at_target():
    b = NspBalance(0.5)
    assert b.free_random_prob() == 0.5
    for _ in range(90):
        b.record(forced=True, label=1)
    assert b.free_random_prob() == 0.0  # more than half forced: free choices all continue
    b = NspBalance(0.5)
    for label in [0] * 10:
        b.record(forced=False, label=label)
    assert b.free_random_prob() == 1.0  # a run of continuations is paid back


_sentences = st.lists(st.integers(min_value=10, max_value=60), max_size=40)


@settings(max_examples=100, deadline=None)
@given(
    docs=st.lists(st.lists(_sentences, max_size=12), max_size=8),
    max_seq_length=st.integers(min_value=8, max_value=64),
    short=st.sampled_from([0.0, 0.1, 1.0]),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_properties_on_arbitrary_documents(docs, max_seq_length, short, seed):
    """Empty and one-token sentences, empty and huge documents: invariants hold, nothing raises."""
    examples, stats = pairs_from_token_lists(docs, max_seq_length, random.Random(seed), short_seq_prob=short)
    assert stats.pairs == len(examples)
    for ex in examples:
        ids, tt = ex["input_ids"], ex["token_type_ids"]
        assert 5 <= len(ids) <= max_seq_length and ids[0] == CLS and ids[-1] == SEP and ids.count(SEP) == 2
        k = ids.index(SEP)
        assert k >= 2 and tt == [0] * (k + 1) + [1] * (len(ids) - k - 1)
        assert set(ids[1:k]) | set(ids[k + 1 : -1]) <= {t for d in docs for s in d for t in s}


def _walk_pairs(doc, sent_bounds, doc_sents, params, rng, balance, stats):
    """The pairing loop written as the reference walks it, one sentence at a time; the library
    finds chunk and B ends by binary search and must consume the RNG and decide identically."""
    first, last = doc_sents[doc], doc_sents[doc + 1]
    n_docs = len(doc_sents) - 1
    target = params.max_num_tokens
    if rng.random() < params.short_seq_prob:
        target = 2 + _below(rng, params.max_num_tokens - 1)
    out, chunk_start, i, chunk_len = [], first, first, 0
    while i < last:
        chunk_len += sent_bounds[i + 1] - sent_bounds[i]
        if i == last - 1 or chunk_len >= target:
            n_seg = i + 1 - chunk_start
            a_end = chunk_start + (1 + _below(rng, n_seg - 1) if n_seg >= 2 else 1)
            a0, a1 = sent_bounds[chunk_start], sent_bounds[a_end]
            forced = n_seg == 1
            want_random = forced or rng.random() < balance.free_random_prob()
            if want_random and n_docs < 2:
                if forced:
                    stats.skipped_single_segment += 1
                    chunk_start, chunk_len, i = i + 1, 0, i + 1
                    continue
                stats.no_other_document += 1
                want_random = False
            if want_random:
                other = _below(rng, n_docs - 1)
                other += other >= doc
                o_first, o_last = doc_sents[other], doc_sents[other + 1]
                s = o_first + _below(rng, o_last - o_first)
                b0 = sent_bounds[s]
                while s < o_last - 1 and sent_bounds[s + 1] - b0 < target - (a1 - a0):
                    s += 1
                b1, i, label = sent_bounds[s + 1], a_end - 1, 1
            else:
                b0, b1, label = a1, sent_bounds[i + 1], 0
            af, ab, bf, bb = truncation_amounts(a1 - a0, b1 - b0, params.max_num_tokens, rng)
            out.append((a0 + af, a1 - ab, b0 + bf, b1 - bb, label))
            balance.record(forced, label)
            stats.pairs += 1
            stats.random_next += label
            stats.forced_random += int(forced)
            stats.truncated_tokens += af + ab + bf + bb
            chunk_start, chunk_len = i + 1, 0
        i += 1
    return out


def _document_pairs(doc, *args):
    """One document's pairs: ``block_pairs`` on it alone, the generator running on."""
    from bert_mp.data.pairs import block_pairs

    return block_pairs([doc], *args)


@pytest.mark.parametrize("seed", range(6))
def test_chunk_search_matches_the_sentence_walk(seed):
    from bert_mp.data.pairs import PairParams, PairStats

    rng = random.Random(seed)
    n_docs = rng.choice([1, 2, 5, 40])
    sents_per_doc = [rng.randint(1, 30) for _ in range(n_docs)]
    lengths = [rng.choice([1, 2, 5, 20, 60, 200]) for _ in range(sum(sents_per_doc))]
    sent_bounds = [0, *np.cumsum(lengths).tolist()]
    doc_sents = [0, *np.cumsum(sents_per_doc).tolist()]
    params = PairParams(rng.choice([5, 29, 125, 509]), short_seq_prob=0.3, nsp_random_prob=0.5)
    got, want = [], []
    for fn, out in ((_document_pairs, got), (_walk_pairs, want)):
        r, balance, stats = random.Random(seed), NspBalance(0.5), PairStats()
        for d in range(n_docs):
            out.extend(fn(d, sent_bounds, doc_sents, params, r, balance, stats))
        out.append(vars(stats))
    assert len(got) > 1 and got == want


@pytest.mark.parametrize("seed", range(4))
def test_block_pairs_equals_each_document_in_turn(seed):
    """prepare pairs a whole block in one call with one generator: the same pairs, balance and
    counts as pairing its documents one at a time with that generator running on."""
    from bert_mp.data.pairs import PairParams, PairStats, block_pairs

    rng = random.Random(seed)
    n_docs = rng.choice([1, 3, 40])
    sents_per_doc = [rng.randint(1, 12) for _ in range(n_docs)]
    lengths = [rng.choice([1, 3, 8, 30, 90]) for _ in range(sum(sents_per_doc))]
    sent_bounds = [0, *np.cumsum(lengths).tolist()]
    doc_sents = [0, *np.cumsum(sents_per_doc).tolist()]
    params = PairParams(61, short_seq_prob=0.2, nsp_random_prob=0.5)
    balance, stats, one = NspBalance(0.5), PairStats(), random.Random(seed)
    want = [
        p
        for d in range(n_docs)
        for p in _document_pairs(d, sent_bounds, doc_sents, params, one, balance, stats)
    ]
    balance2, stats2 = NspBalance(0.5), PairStats()
    got = block_pairs(range(n_docs), sent_bounds, doc_sents, params, random.Random(seed), balance2, stats2)
    assert len(got) >= n_docs and got == want and vars(stats2) == vars(stats) and balance2 == balance
