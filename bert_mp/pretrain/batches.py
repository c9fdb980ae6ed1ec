"""Which examples each rank trains on at each step: a function of (seed, epoch, position) only."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import Dataset

from bert_mp.core.loop.epochs import epoch_order


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
