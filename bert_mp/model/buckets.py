"""Batch shapes for ``train.compile``: every size a compiled graph sees is one of a few buckets.

Dynamo (``dynamic=False``) compiles one graph per set of input shapes. Left alone, a pretraining run
shows it a new shape for every padded length, every masked-token count and, on the unpadded path,
every number of sequences (pairs of packed rows, documents of blocked MLM rows): it recompiles
until it hits its recompile limit and then runs the rest of the run uncompiled. Under compile:

- the collator pads each batch to one of :func:`length_bucket`'s lengths (padded path) or to
  ``max_seq_length`` (unpadded path: the padded copy only feeds the host-side unpadding), and keeps
  one row per example for packed batches (empty rows carry no token), so the compiled module's
  inputs have one of a few shapes;
- the masked-token gather has a fixed size (``max_predictions_per_seq`` per sequence);
- the unpadded stream is padded with filler tokens to a token bucket (``unpad.token_bucket``) and
  the sequences with empty filler sequences to a :func:`sequence_bucket`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def length_bucket(length: int, max_length: int, buckets: int = 4, multiple: int = 8) -> int:
    """``length`` rounded up to one of at most ``buckets`` lengths, multiples of ``multiple``, the
    largest ``max_length`` (when the batch fits it)."""
    step = -(-max(max_length, 1) // buckets // multiple) * multiple
    step = max(step, multiple)
    return max(min(-(-max(length, 1) // step) * step, max_length), length)


def sequence_bucket(n: int, rows: int) -> int:
    """The number of sequences ``n`` of a ``rows``-row batch rounded up to ``rows`` times a power of
    two: ``log2(sequences per row) + 1`` sizes at most."""
    size = max(rows, 1)
    while size < n:
        size *= 2
    return size


def collate_length(max_seq_length: int, unpad: bool) -> Callable[[int], int]:
    """The collator's padded length under compile: ``max_seq_length`` on the unpadded path (only the
    host-side unpadding reads the padded copy), else one of :func:`length_bucket`'s four lengths."""
    if unpad:
        return lambda length: max(length, max_seq_length)
    return lambda length: length_bucket(length, max_seq_length)


def shape_buckets(max_seq_length: int, unpad: bool, segments: bool) -> int:
    """How many input shapes a compiled frame sees at most for one row count, grad mode and mask
    presence: four padded lengths; unpadded, eight stream lengths (``unpad.token_bucket``) times the
    sequence buckets of packed or blocked rows (at most ``max_seq_length // 2`` sequences a row)."""
    if not unpad:
        return 4
    per_row = max(max_seq_length // 2, 1) if segments else 1
    return 8 * len({sequence_bucket(n, 1) for n in range(1, per_row + 1)})


def allow_recompiles(data_cfg: Any, unpad: bool) -> int:
    """Raise dynamo's recompile limits (8 per frame, 256 per code object by default) above the bound
    of :func:`shape_buckets`, so a bounded run never falls back to eager; returns the per-frame limit.

    The bound is multiplied by 8 (training and evaluation, a full and a smaller last batch, with and
    without a padding mask) and by 4 for frames that several callers share (transformers' deprecation
    wrapper serves the encoder, the layers and attention with one code object).
    """
    import torch._dynamo

    segments = bool(data_cfg.pack_pairs) or (
        data_cfg.objective == "mlm" and data_cfg.mlm_document_attention == "block"
    )
    config = torch._dynamo.config
    limit = max(
        int(config.recompile_limit), 32 * shape_buckets(int(data_cfg.max_seq_length), unpad, segments)
    )
    config.recompile_limit = limit
    config.accumulated_recompile_limit = max(int(config.accumulated_recompile_limit), 8 * limit)
    return limit


def masked_per_row(data_cfg: Any) -> int:
    """The static masked-token gather's positions per row: ``max_predictions_per_seq``; with
    ``data.token_budget`` at least the masking budget of a full row (several examples share a row)."""
    if getattr(data_cfg, "token_budget", False):
        return max(data_cfg.max_predictions(), data_cfg.masking_budget())
    return data_cfg.max_predictions()
