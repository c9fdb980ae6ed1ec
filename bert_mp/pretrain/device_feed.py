"""Host-side settings that keep a GPU fed: DataLoader workers and pinned memory by device.

On CUDA the collator (dynamic masking, padding) runs in worker processes so batch ``n+1`` is built
while the GPU runs batch ``n``, and batches land in page-locked memory so ``.to(device,
non_blocking=True)`` is a real asynchronous copy. On CPU the same cores do the training, so the
default stays in-process. Masking depends on ``(seed, epoch, index)`` only, so the number of
workers never changes the data.
"""

from __future__ import annotations

import os
from typing import Any

import torch

AUTO_CUDA_WORKERS = 4


def loader_kwargs(num_workers: int, pin_memory: bool | None, device: torch.device) -> dict[str, Any]:
    """``DataLoader`` keyword arguments for ``train.num_workers`` / ``train.pin_memory`` on ``device``.

    ``num_workers=-1`` (auto): :data:`AUTO_CUDA_WORKERS` on CUDA (at most the CPUs this process may
    use, minus one for the training process), 0 elsewhere. ``pin_memory=None`` (auto): True on CUDA.
    """
    cuda = torch.device(device).type == "cuda"
    if num_workers < 0:
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:
            cpus = os.cpu_count() or 1
        num_workers = min(AUTO_CUDA_WORKERS, max(0, cpus - 1)) if cuda else 0
    pin = cuda if pin_memory is None else bool(pin_memory and cuda)
    out: dict[str, Any] = {"num_workers": num_workers, "pin_memory": pin}
    if num_workers > 0:
        out["persistent_workers"] = True
        out["prefetch_factor"] = 4
    return out
