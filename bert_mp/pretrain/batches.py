"""Which examples each rank trains on at each step: a function of (seed, epoch, position) only."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from bert_mp.core.loop.epochs import epoch_order
from bert_mp.core.loop.state import LoopState
from bert_mp.data.packing import examples_per_row, fill_rows
from bert_mp.errors import DataError


class IndexedSplit(Dataset):
    """Split rows addressed by ``(epoch, index)``, with both added as features for the collator."""

    def __init__(self, ds: Any):
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        epoch, index = key
        row = dict(self.ds[int(index)])
        row["index"] = int(index)
        row["epoch"] = int(epoch)
        return row


class MicroBatchSampler:
    """Endless micro-batches of ``(epoch, index)`` keys for one rank, starting at a data position.

    Step ``b`` of epoch ``e`` uses ``epoch_order(e)[b*G:(b+1)*G]``; rank ``r`` takes its contiguous
    ``G / world`` slice and cuts it into micro-batches. The last partial global batch is dropped.
    """

    def __init__(
        self, n: int, global_bs: int, micro_bs: int, rank: int, world: int, seed: int, epoch: int, batch: int
    ):
        self.n, self.global_bs, self.micro_bs = n, global_bs, micro_bs
        self.rank, self.world, self.seed = rank, world, seed
        self.start = (epoch, batch)
        self.batches_per_epoch = n // global_bs

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch, first = self.start
        per_rank = self.global_bs // self.world
        while True:
            order = epoch_order(self.n, self.seed, epoch)
            for b in range(first, self.batches_per_epoch):
                mine = order[b * self.global_bs + self.rank * per_rank :][:per_rank]
                for i in range(0, per_rank, self.micro_bs):
                    yield [(epoch, int(j)) for j in mine[i : i + self.micro_bs]]
            epoch, first = epoch + 1, 0

    def advance(self, state: LoopState) -> None:
        """Count one consumed step in ``state``'s data position."""
        state.advance_batch(self.batches_per_epoch)


def example_lengths(ds: Any) -> np.ndarray:
    """Tokens of every example of a split, read from its Arrow column (no row decoding)."""
    import pyarrow.compute as pc

    return pc.list_value_length(ds.with_format("arrow")[:]["input_ids"]).to_numpy(zero_copy_only=False)


class TokenBudgetSampler:
    """``data.token_budget``: micro-batches of ``rows`` rows of ``length`` tokens, for one rank.

    Each micro-batch is the longest run of the epoch's order, from where the previous one stopped,
    that :func:`bert_mp.data.packing.fill_rows` places; the example that does not fit starts the next
    one (carried whole, never cut, never dropped inside an epoch). A step is ``accumulation x world``
    consecutive micro-batches, rank ``r`` takes the ``accumulation`` after the first ``r x
    accumulation``. An epoch whose rest cannot fill one more step ends there (dropped, like the
    padded order's last partial global batch). Where the data stands after a step - the epoch, the
    examples of its order consumed (``data_offset``, the carry's own position) and the steps of the
    epoch - is a function of the lengths and ``(seed, epoch)`` only; the loop checkpoints it and a
    resume starts there (:meth:`advance`), with the very same micro-batches.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        rows: int,
        length: int,
        accumulation: int,
        rank: int,
        world: int,
        seed: int,
        start: tuple[int, int, int],
    ):
        self.lengths, self.rows, self.length = np.asarray(lengths), rows, length
        self.per_row = examples_per_row(length)
        self.accumulation, self.rank, self.world, self.seed = accumulation, rank, world, seed
        self.start = start
        """``(epoch, data_offset, batch_in_epoch)`` of the first step."""
        self.positions: deque[tuple[int, int, int]] = deque()
        """The position after each planned step, oldest first: the loader plans ahead of the loop."""
        longest = int(self.lengths.max()) if self.lengths.size else 0
        if longest > length:
            raise DataError(f"an example has {longest} tokens, more than data.max_seq_length={length}")

    def _micro_batch(self, order: np.ndarray, offset: int) -> int:
        """How many examples of ``order`` from ``offset`` on fill one micro-batch."""
        ahead = self.lengths[order[offset : offset + self.rows * self.per_row]]
        return sum(len(r) for r in fill_rows(ahead.tolist(), self.rows, self.length, self.per_row))

    def _step(self, order: np.ndarray, offset: int) -> list[tuple[int, int]] | None:
        """The ``(start, end)`` in ``order`` of a step's micro-batches, or None when the epoch's rest
        cannot fill them all."""
        spans = []
        for _ in range(self.accumulation * self.world):
            taken = self._micro_batch(order, offset)
            if not taken:
                return None
            spans.append((offset, offset + taken))
            offset += taken
        return spans

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch, offset, done = self.start
        while True:
            order = epoch_order(len(self.lengths), self.seed, epoch)
            spans = self._step(order, offset)
            if spans is None:
                if offset == 0:
                    raise DataError(
                        f"the train split ({len(self.lengths)} examples) cannot fill one step of "
                        f"{self.accumulation * self.world} token-budget micro-batches; prepare more data "
                        "or lower train.global_batch_size"
                    )
                epoch, offset, done = epoch + 1, 0, 0
                continue
            offset, done = spans[-1][1], done + 1
            self.positions.append((epoch, offset, done))
            first = self.rank * self.accumulation
            for a, b in spans[first : first + self.accumulation]:
                yield [(epoch, int(j)) for j in order[a:b]]

    def advance(self, state: LoopState) -> None:
        """Set ``state``'s data position to the one after the step the loop has just consumed."""
        state.epoch, state.data_offset, state.batch_in_epoch = self.positions.popleft()
