"""NSP pair creation with the original BERT data-generator semantics, as pure functions.

A block of documents is held as one flat token array plus sentence offsets, so every segment is
a contiguous slice and a pair is five integers ``(a_start, a_end, b_start, b_end, label)``. Per
document (the original BERT generator): a target length (``max_seq_length - 3``, or with ``short_seq_prob`` a
random length in ``[2, max]``); sentences accumulate into a chunk until the target is reached; a
random split point makes A; with probability ``p`` (always when the chunk has one segment) B
comes from a *different* document of the block and the unused segments are put back, otherwise B
is the rest of the chunk; the pair is truncated by removing tokens from the longer side, front or
back at random. Labels: 0 = B continues A, 1 = B is random.

Label balance: the forced random B of one-segment chunks pushes the random share above
``nsp_random_prob`` on corpora of short documents. :class:`NspBalance` compensates
deterministically: free choices use ``p = (r - f) / (1 - f)``, with ``f`` the share of forced
randoms seen so far in the block, so the expected share of random pairs stays ``r``.
"""

from __future__ import annotations

import random
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class PairStats:
    """Counts of what pairing did (summed over blocks into ``stats.json``)."""

    pairs: int = 0
    random_next: int = 0
    forced_random: int = 0
    """Chunks with one segment, whose B had to be random (reference behaviour)."""
    no_other_document: int = 0
    """Chunks that wanted a random B but the block has no other document: kept as continuation."""
    skipped_single_segment: int = 0
    """One-segment chunks dropped because no other document exists for a random B."""
    truncated_tokens: int = 0

    def add(self, other: PairStats) -> None:
        for k, v in vars(other).items():
            setattr(self, k, getattr(self, k) + v)


@dataclass
class NspBalance:
    """Running counts in a block; tells free choices how often to take a random B.

    ``p = (r - f) / (1 - f)`` with ``f`` the running share of forced randoms gives the right
    expected share; a proportional term on the running surplus of random pairs keeps the realised
    share close to ``r`` as well (a few pairs' worth of deviation, not a drift).
    """

    target: float
    total: int = 0
    forced: int = 0
    random: int = 0
    prior: int = field(default=10, repr=False)
    """Pseudo-count of unforced pairs, so the first chunks use ``target`` unchanged."""
    gain: float = field(default=0.1, repr=False)
    """Change of ``p`` per pair of surplus (or deficit) of random pairs."""

    def free_random_prob(self) -> float:
        return _free_random_prob(self.target, self.prior, self.gain, self.total, self.forced, self.random)

    def record(self, forced: bool, label: int) -> None:
        self.total += 1
        self.forced += int(forced)
        self.random += label


@dataclass(frozen=True)
class PairParams:
    max_num_tokens: int
    """``max_seq_length - 3``: room for A and B next to [CLS] and two [SEP]."""
    short_seq_prob: float = 0.1
    nsp_random_prob: float = 0.5


def _truncate(len_a: int, len_b: int, max_num_tokens: int, getrandbits: Any) -> tuple[int, int, int, int]:
    """Tokens to drop ``(a_front, a_back, b_front, b_back)`` so that ``len_a + len_b <= max_num_tokens``
    (for a pair that does not fit).

    Same distribution as the reference loop (drop one token from the longer side - B on a tie -
    front or back with equal odds, until it fits) in O(1): the per-side totals are determined by
    the lengths, and the front share of k fair coin flips is Binomial(k, 1/2).
    """
    excess = len_a + len_b - max_num_tokens
    if len_a > len_b:
        d = len_a - len_b
        drop_a, drop_b = (excess, 0) if excess <= d else (d + (excess - d) // 2, (excess - d + 1) // 2)
    else:
        d = len_b - len_a
        drop_a, drop_b = (0, excess) if excess <= d else ((excess - d) // 2, d + (excess - d + 1) // 2)
    a_front = getrandbits(drop_a).bit_count() if drop_a else 0
    b_front = getrandbits(drop_b).bit_count() if drop_b else 0
    return a_front, drop_a - a_front, b_front, drop_b - b_front


def block_pairs(
    docs: Sequence[int],
    sent_bounds: Sequence[int],
    doc_sents: Sequence[int],
    params: PairParams,
    rng: random.Random,
    balance: NspBalance,
    stats: PairStats,
) -> list[tuple[int, int, int, int, int]]:
    """Pairs ``(a0, a1, b0, b1, label)`` of ``docs`` (token spans of the block: sentence ``s`` is
    ``sent_bounds[s:s+2]``, document ``d`` sentences ``doc_sents[d:d+2]``), drawing from ``rng`` in
    document order (prepare seeds one generator per block).

    A uniform integer in ``[0, n)`` is ``int(random() * n)``: ~10x cheaper than ``randrange``, and its
    bias (below 2**-40 for any realistic ``n``) is far beneath anything pairing can notice."""
    uniform, getrandbits = rng.random, rng.getrandbits
    n_docs, max_tokens, short_prob = len(doc_sents) - 1, params.max_num_tokens, params.short_seq_prob
    b_target, b_prior, b_gain = balance.target, balance.prior, balance.gain
    b_total, b_forced, b_random = balance.total, balance.forced, balance.random
    n_skipped = n_no_other = n_truncated = 0
    out: list[tuple[int, int, int, int, int]] = []
    append = out.append
    for doc in docs:
        first, last = doc_sents[doc], doc_sents[doc + 1]
        target = max_tokens
        if uniform() < short_prob:
            target = 2 + int(uniform() * (max_tokens - 1))
        chunk_start = first
        while chunk_start < last:
            # the chunk ends at the first sentence that brings it to the target length, or at the
            # document's last sentence (a binary search on the sentence offsets, not a walk)
            i = bisect_left(sent_bounds, sent_bounds[chunk_start] + target, chunk_start + 1, last) - 1
            n_seg = i + 1 - chunk_start
            a_end_sent = chunk_start + (1 + int(uniform() * (n_seg - 1)) if n_seg >= 2 else 1)
            a0, a1 = sent_bounds[chunk_start], sent_bounds[a_end_sent]
            forced = n_seg == 1
            if forced:
                want_random = True
            else:  # _free_random_prob inline, unclamped: uniform() < p decides alike for p off [0, 1]
                f = b_forced / (b_total + b_prior)
                p = (b_target - f) / (1.0 - f) + b_gain * (b_target * b_total - b_random) if f < 1.0 else 0.0
                want_random = uniform() < p
            if want_random and n_docs < 2:
                if forced:
                    n_skipped += 1
                    chunk_start = i + 1
                    continue
                n_no_other += 1
                want_random = False
            if want_random:
                other = int(uniform() * (n_docs - 1))
                other += other >= doc
                o_first, o_last = doc_sents[other], doc_sents[other + 1]
                s = o_first + int(uniform() * (o_last - o_first))
                b0 = sent_bounds[s]
                # B runs to the first sentence that brings it to target - len(A), or the document's end
                s = bisect_left(sent_bounds, b0 + target - (a1 - a0), s + 1, o_last) - 1
                b1 = sent_bounds[s + 1]
                i = a_end_sent - 1  # the chunk's unused segments go back for the next chunk
                label = 1
            else:
                b0, b1 = a1, sent_bounds[i + 1]
                label = 0
            if a1 - a0 + b1 - b0 > max_tokens:
                af, ab, bf, bb = _truncate(a1 - a0, b1 - b0, max_tokens, getrandbits)
                n_truncated += af + ab + bf + bb
                append((a0 + af, a1 - ab, b0 + bf, b1 - bb, label))
            else:
                append((a0, a1, b0, b1, label))
            b_total += 1
            b_forced += forced
            b_random += label
            chunk_start = i + 1
    stats.no_other_document += n_no_other
    stats.skipped_single_segment += n_skipped
    stats.truncated_tokens += n_truncated
    _write_back(stats, balance, b_total, b_forced, b_random)
    return out


def _free_random_prob(
    target: float, prior: float, gain: float, total: int, forced: int, random_: int
) -> float:
    """:meth:`NspBalance.free_random_prob` on the block loop's local counts."""
    f = forced / (total + prior)
    if f >= 1.0:
        return 0.0
    return min(1.0, max(0.0, (target - f) / (1.0 - f) + gain * (target * total - random_)))


def _write_back(stats: PairStats, balance: NspBalance, total: int, forced: int, random_: int) -> None:
    """The block loop's running counts back into ``stats`` and ``balance``."""
    stats.pairs += total - balance.total
    stats.random_next += random_ - balance.random
    stats.forced_random += forced - balance.forced
    balance.total, balance.forced, balance.random = total, forced, random_


def build_examples(
    flat: np.ndarray, pairs: Sequence[tuple[int, int, int, int, int]], cls_id: int, sep_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Lay out ``[CLS] A [SEP] B [SEP]`` for all pairs at once, without a per-token Python loop.

    Returns ``(input_ids, token_type_ids, offsets, next_sentence_label)``: the first two are flat
    (example ``k`` is ``[offsets[k]:offsets[k + 1]]``), ready for an Arrow list column.
    """
    p = np.asarray(pairs, dtype=np.int64).reshape(-1, 5)
    n = len(p)
    ext = np.concatenate([flat.astype(np.int32, copy=False), np.array([cls_id, sep_id], dtype=np.int32)])
    cls_pos, sep_pos = len(flat), len(flat) + 1
    # five pieces per example: [CLS], A, [SEP], B, [SEP] as (start in ext, length)
    starts = np.stack([np.full(n, cls_pos), p[:, 0], np.full(n, sep_pos), p[:, 2], np.full(n, sep_pos)], 1)
    lengths = np.stack([np.ones(n, np.int64), p[:, 1] - p[:, 0], np.ones(n, np.int64), p[:, 3] - p[:, 2]], 1)
    lengths = np.concatenate([lengths, np.ones((n, 1), np.int64)], 1)
    starts, lengths = starts.ravel(), lengths.ravel()
    piece_offsets = np.cumsum(lengths) - lengths
    gather = np.arange(lengths.sum()) - np.repeat(piece_offsets - starts, lengths)
    input_ids = ext[gather]
    token_type_ids = np.repeat(np.tile(np.array([0, 0, 0, 1, 1], np.int8), n), lengths)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths.reshape(n, 5).sum(1), out=offsets[1:])
    return input_ids, token_type_ids, offsets, p[:, 4].astype(np.int64)
