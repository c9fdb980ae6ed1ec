"""Validation of a pretraining run: MLM/NSP loss, accuracy and perplexity, masking fixed at epoch 0."""

from __future__ import annotations

import math
from typing import Any

import torch

from bert_mp.model.bert import mark_step
from bert_mp.pretrain.step import SUM_KEYS


@torch.no_grad()
def evaluate(model: Any, val_ds: Any, collator: Any, cfg: Any, accelerator: Any, plan: Any) -> dict:
    """MLM/NSP loss and accuracy and perplexity on the validation split (masking fixed: epoch 0)."""
    n, micro = len(val_ds), cfg.train.micro_batch_size
    n_batches = math.ceil(n / micro)
    if cfg.train.eval_max_batches:
        n_batches = min(n_batches, cfg.train.eval_max_batches)
    world, rank = accelerator.num_processes, accelerator.process_index
    sums = torch.zeros(len(SUM_KEYS), dtype=torch.float64, device=accelerator.device)
    model.eval()
    # Every rank runs the same number of forwards (sharded models need all ranks in each one); a
    # rank without a batch of its own repeats batch 0 with weight 0.
    for r in range(math.ceil(n_batches / world)):
        b = r * world + rank
        weight = 1.0 if b < n_batches else 0.0
        b = b if b < n_batches else 0
        feats = []
        for i in range(b * micro, min(n, (b + 1) * micro)):
            row = dict(val_ds[i])
            row["index"], row["epoch"] = i, 0
            feats.append(row)
        batch = {k: v.to(accelerator.device) for k, v in collator(feats).items()}
        mark_step()  # CUDA graphs: the last replay's outputs were consumed
        with plan.autocast():
            out = model(**batch)
        sums += weight * torch.stack([out[k].double() for k in SUM_KEYS])
    model.train()
    s = dict(zip(SUM_KEYS, accelerator.reduce(sums, reduction="sum").tolist()))
    masked, seqs = max(s["mlm_count"], 1.0), s["nsp_count"]
    mlm = s["mlm_loss_sum"] / masked
    return {
        "eval/loss_mlm": mlm,
        "eval/loss_nsp": s["nsp_loss_sum"] / seqs if seqs else None,  # None: no NSP labels (objective=mlm)
        "eval/accuracy_mlm": s["mlm_correct"] / masked,
        "eval/accuracy_nsp": s["nsp_correct"] / seqs if seqs else None,
        "eval/perplexity": math.exp(min(mlm, 80.0)),
        "eval/masked_tokens": int(s["mlm_count"]),
    }
