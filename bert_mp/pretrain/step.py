"""One pretraining step's forward/backward and its cross-process totals, read by name.

Semantics: a step is ``global_batch_size`` sequences, ``accumulation`` micro-batches per rank. The
MLM loss of the step is divided by the masked-token count of the *whole step* (all micro-batches,
all ranks) and the NSP loss by its sequence count, so k micro-batches give exactly the gradient of
one k-times larger batch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from bert_mp.core.engine import gradients
from bert_mp.model.bert import drop_full_attention_mask, mark_step
from bert_mp.pretrain.monitors import LossSums, attention_flops_tokens

SUM_KEYS = tuple(f.name for f in fields(LossSums))
"""The loss sums and counts ``PretrainingModel`` returns for a batch."""


@dataclass
class StepTotals(LossSums):
    """A step's figures summed over its micro-batches and all ranks: ONE fused all-reduce, by name."""

    tokens: float
    """Non-padding tokens."""
    padded_tokens: float
    """Positions computed, padding included."""
    attention_flops_tokens: float
    """Sum over sequences of real_length^2 (the attention term of the FLOP count)."""
    sequences: float
    """Examples trained (``global_batch_size``, or with ``data.token_budget`` those its rows hold)."""
    stop_flag: float
    """Ranks that received a stop signal: above 0 means every rank stops after this step."""

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def reduce(cls, local: dict[str, torch.Tensor], accelerator: Any) -> torch.Tensor:
        """All-reduce this rank's float32 scalars (one per field, any order in ``local``) as ONE vector.

        The result stays on the device (nothing is read back): :meth:`read` or a metrics buffer turns it
        into figures when the host needs them.
        """
        names = cls.names()
        missing = set(names) ^ set(local)
        assert not missing, f"step totals and local figures differ in {sorted(missing)}"
        return accelerator.reduce(torch.stack([local[n] for n in names]), reduction="sum")

    @classmethod
    def from_values(cls, values: Any) -> StepTotals:
        """Figures from a reduced vector's values (host numbers, in field order)."""
        return cls(**{n: float(v) for n, v in zip(cls.names(), values)})

    @classmethod
    def read(cls, reduced: torch.Tensor) -> StepTotals:
        """Read a reduced vector back to the host now (one device sync)."""
        return cls.from_values(reduced.tolist())

    @property
    def loss(self) -> float:
        """Total loss of the step: MLM per masked token plus NSP per sequence."""
        return self.mlm_loss_sum / max(self.mlm_count, 1.0) + self.nsp_loss_sum / max(self.nsp_count, 1.0)

    def sums(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in SUM_KEYS}


def forward_backward(
    model: Any, micro: list[dict], accelerator: Any, plan: Any, per_rank: int
) -> dict[str, torch.Tensor]:
    """Forward and backward over one rank's micro-batches; returns the rank's figures for the totals.

    Gradients are synchronised across ranks on the last micro-batch only.
    """
    device, world = accelerator.device, accelerator.num_processes
    # Normalisers of the whole step: masked tokens and NSP examples over all micro-batches and ranks.
    # The labels are still on the host; with several ranks both are all-reduced (one call) and used as
    # device tensors, so nothing is read back before the forward passes.
    examples = sum(batch_examples(b, per_rank // len(micro)) for b in micro)
    n_masked: Any = float(sum(int((b["labels"] != -100).sum()) for b in micro))
    n_seqs: Any = (
        float(sum(nsp_examples(b) for b in micro)) if "next_sentence_label" in micro[0] else examples
    )
    if world > 1:
        # torch.full fills on the device from a host scalar: no blocking host-to-device copy
        norms = torch.stack([torch.full((), float(v), device=device) for v in (n_masked, n_seqs)])
        n_masked, n_seqs = accelerator.reduce(norms, reduction="sum").clamp(min=1.0).unbind()
    else:
        n_masked, n_seqs = max(n_masked, 1.0), max(float(n_seqs), 1.0)
    sums = torch.zeros(len(SUM_KEYS), device=device)
    for i, batch in enumerate(micro):
        batch = drop_full_attention_mask(batch)  # no mask at all lets SDPA pick its flash kernel
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with gradients.micro_batch(accelerator, model, last=i == len(micro) - 1):
            mark_step()  # CUDA graphs: the last replay's outputs were consumed (the sums below copy them)
            with plan.autocast():
                o = model(**batch)
            # x world: DDP averages gradients over ranks, the normalisers are already global
            loss = world * (o["mlm_loss_sum"] / n_masked + o["nsp_loss_sum"] / n_seqs)
            gradients.backward(accelerator, loss)
        sums += torch.stack([o[k].detach().float() for k in SUM_KEYS])
    masks = [b["attention_mask"] for b in micro]
    figures = dict(zip(SUM_KEYS, sums))
    figures["tokens"] = sum(int(m.sum()) for m in masks)
    figures["padded_tokens"] = sum(m.numel() for m in masks)
    figures["attention_flops_tokens"] = sum(
        attention_flops_tokens(b["attention_mask"], b.get("segment_ids")) for b in micro
    )
    figures["sequences"] = examples
    return {k: device_scalar(v, device) for k, v in figures.items()}


def batch_examples(batch: dict, default: int) -> int:
    """Examples in a host batch: a token-budget batch's (each starts at position 0), else ``default``
    (one a row; packed pairs hold ``train.micro_batch_size`` too)."""
    if "cls_index" not in batch:
        return default
    return int(((batch["position_ids"] == 0) & (batch["attention_mask"] != 0)).sum())


def nsp_examples(batch: dict) -> int:
    """NSP examples in a host batch (token-budget batches label their filler slots -100)."""
    return int((batch["next_sentence_label"] != -100).sum())


def device_scalar(value: Any, device: torch.device) -> torch.Tensor:
    """A float32 0-d tensor on ``device``: a device tensor is cast in place, a host number is filled in
    by a kernel (``torch.full``) instead of ``torch.tensor(..., device=)``, a blocking host-to-device copy."""
    if torch.is_tensor(value):
        return value.to(device=device, dtype=torch.float32)
    return torch.full((), float(value), dtype=torch.float32, device=device)
