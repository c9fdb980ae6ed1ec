"""Per-step scalars kept on the device and read back to the host only at log points.

Every ``float(t)`` / ``t.item()`` / ``t.tolist()`` of a CUDA tensor blocks the host until the GPU has
caught up, so the host cannot queue the next step's kernels while the current one runs. A training
step that reads its loss, gradient norm and counters back every step therefore pays a fixed stall per
step, which grows in relative terms exactly when mixed precision makes the GPU work short.
:class:`DeviceStepMetrics` records each step's scalars as one row of a device tensor (an
asynchronous copy-free ``torch.stack``) and :meth:`DeviceStepMetrics.flush` copies all pending rows
to the host in a single transfer - one sync per ``log_every`` steps instead of several per step.
Host-side facts (wall times, token counts from the CPU batch) travel alongside as plain numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class DeviceStepMetrics:
    """Buffer of per-step device scalars under fixed ``keys``; rows come back as dicts on :meth:`flush`.

    ``record(step, values, host=...)``: ``values`` maps every key to a 0-d tensor (or a Python
    number) of this step; nothing is read back. ``flush()`` returns the pending rows (oldest first),
    each ``{"step": s, **host, key: float}``, with one device-to-host copy, and empties the buffer.
    ``should_flush(step)`` says whether ``step`` is a log point (every ``log_every`` steps, or when the
    buffer is full).
    """

    keys: Sequence[str]
    log_every: int = 10
    max_pending: int = 1000
    """Flush at least this often whatever ``log_every`` says (bounds device memory for the buffer)."""
    _rows: list[torch.Tensor] = field(default_factory=list, repr=False)
    _meta: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.log_every < 1:
            raise ValueError(f"log_every must be >= 1 (got {self.log_every})")
        self.keys = tuple(self.keys)

    def record(
        self, step: int, values: dict[str, Any] | torch.Tensor, host: dict[str, Any] | None = None
    ) -> None:
        """Queue one step's scalars without reading them back.

        ``values``: a dict with every key (0-d tensors or numbers), or a 1-d tensor with one value per
        key in ``keys`` order (e.g. a step's all-reduced totals with the gradient norm appended).
        """
        if torch.is_tensor(values):
            if values.numel() != len(self.keys):
                raise ValueError(f"step metrics row has {values.numel()} values for {len(self.keys)} keys")
            row = values.detach().reshape(-1).to(torch.float64)
        else:
            missing = [k for k in self.keys if k not in values]
            if missing:
                raise KeyError(f"step metrics missing {missing}; expected keys {list(self.keys)}")
            device = next((v.device for v in values.values() if torch.is_tensor(v)), torch.device("cpu"))
            row = torch.stack(
                [
                    (
                        v.detach().reshape(())
                        if torch.is_tensor(v)
                        else torch.tensor(float(v), device=device)
                    ).to(device=device, dtype=torch.float64)
                    for v in (values[k] for k in self.keys)
                ]
            )
        self._rows.append(row)
        self._meta.append({"step": int(step), **(host or {})})

    @property
    def pending(self) -> int:
        return len(self._rows)

    def should_flush(self, step: int) -> bool:
        return step % self.log_every == 0 or self.pending >= self.max_pending

    def flush(self) -> list[dict[str, Any]]:
        """All pending rows as host dicts (one device-to-host copy); the buffer is emptied."""
        if not self._rows:
            return []
        # the only sync: one copy of a (pending x keys) fp64 matrix
        values = torch.stack([r.to(self._rows[0].device) for r in self._rows]).cpu().tolist()
        out = [{**meta, **dict(zip(self.keys, row))} for meta, row in zip(self._meta, values)]
        self._rows.clear()
        self._meta.clear()
        return out
