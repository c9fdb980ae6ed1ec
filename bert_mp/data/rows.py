"""``data.token_budget``: a micro-batch's examples laid out in full rows of one shape.

The sampler (``bert_mp.pretrain.batches.TokenBudgetSampler``) picks the longest run of the epoch's
order that :func:`bert_mp.data.packing.fill_rows` fits into ``rows`` rows of ``max_seq_length``; this
module lays those examples out, first fit again (the same placement), with everything the encoder
needs to keep them apart. Every size is fixed by ``rows`` and ``max_seq_length`` alone: the rows,
``examples_per_row`` NSP slots a row (the NSP labels and each example's ``[CLS]``, filler slots
labelled -100) and the cumulative lengths torch's varlen kernel takes (every example and every row's
padded tail a sequence, filler entries repeating the total: empty sequences).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from bert_mp.data.packing import examples_per_row, fill_rows

if TYPE_CHECKING:
    import torch

ROW_KEYS = ("segment_ids", "position_ids", "cls_index", "cu_seqlens")
"""What a token-budget batch carries besides the padded batch's tensors."""


def collate_rows(
    features: list[dict[str, Any]],
    example: Callable[[dict[str, Any]], tuple[Any, Any]],
    rows: int,
    length: int,
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """``features`` (in order) first fit into ``rows`` rows of ``length``; ``example(f)`` gives a feature's
    (masked input ids, labels). Raises ValueError when they do not all fit (the sampler guarantees it
    for training batches; an evaluation batch holds at most ``rows`` examples, one a row at worst)."""
    import torch

    per_row = examples_per_row(length)
    placement = fill_rows([len(f["input_ids"]) for f in features], rows, length, per_row)
    if sum(len(r) for r in placement) != len(features):
        raise ValueError(
            f"{len(features)} examples do not fit {rows} rows of {length} tokens "
            f"(at most {per_row} a row); data.token_budget's sampler picks only what fits"
        )
    shape = (rows, length)
    input_ids = np.full(shape, pad_token_id, dtype=np.int64)
    labels = np.full(shape, -100, dtype=np.int64)
    token_type_ids, attention_mask = np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.int64)
    segment_ids, position_ids = np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.int64)
    slots = rows * per_row
    cls_index, nsp = np.zeros(slots, dtype=np.int64), np.full(slots, -100, dtype=np.int64)
    bounds = [0]
    n = 0
    for r, row in enumerate(placement):
        at = 0
        for s, i in enumerate(row, start=1):
            f = features[i]
            k = len(f["input_ids"])
            input_ids[r, at : at + k], labels[r, at : at + k] = example(f)
            token_type_ids[r, at : at + k] = f["token_type_ids"]
            attention_mask[r, at : at + k], segment_ids[r, at : at + k] = 1, s
            position_ids[r, at : at + k] = np.arange(k)
            cls_index[n] = r * length + at
            nsp[n] = int(f.get("next_sentence_label", -100))
            n, at = n + 1, at + k
            bounds.append(r * length + at)
        if at < length:  # the row's padded tail: a sequence of its own for the varlen kernel
            bounds.append((r + 1) * length)
    cu_seqlens = np.full(slots + rows + 1, rows * length, dtype=np.int32)
    cu_seqlens[: len(bounds)] = bounds
    arrays = dict(
        input_ids=input_ids,
        token_type_ids=token_type_ids,
        attention_mask=attention_mask,
        labels=labels,
        segment_ids=segment_ids,
        position_ids=position_ids,
        cls_index=cls_index,
        cu_seqlens=cu_seqlens,
    )
    if "next_sentence_label" in features[0]:
        arrays["next_sentence_label"] = nsp
    return {k: torch.from_numpy(v) for k, v in arrays.items()}
