"""``data.token_budget`` batches through the stock ``BertForPreTraining``: full rows, examples kept apart.

A token-budget batch (``bert_mp.data.rows``) is ``rows x max_seq_length`` tokens holding several
examples a row. The encoder runs on the rows as they are - no gather, no scatter, one shape every
step - and each example attends only within itself:

- ``sdpa`` / ``eager`` with a block-diagonal mask built from ``segment_ids`` (a token sees the tokens
  of its own example; padding sees padding, so no query row is empty) - every device, attention
  dropout included;
- torch's varlen flash kernel (``torch.nn.attention.varlen``) on the flattened rows, with the batch's
  fixed-size ``cu_seqlens``, where it applies: CUDA, bf16 / fp16 activations, no attention dropout
  (evaluation, or ``model.attention_probs_dropout_prob=0``) and ``model.attention_kernel`` auto or
  flash. torch 2.13's CPU build has no kernel behind it.

Position ids restart at every example and the pooler + NSP head read each example's ``[CLS]``
(``cls_index``: a fixed number of slots, fillers labelled -100). Parameters, state-dict keys and the
export are the stock ones.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bert_mp.model.attention import attention_backends
from bert_mp.model.unpad import flash_varlen_kernel

PREFIX = "bert_mp_rows_"
ROUTES = ("varlen", "block_diagonal")


def block_diagonal_mask(segment_ids: torch.Tensor, additive_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``(rows, 1, L, L)``: True where query and key belong to the same example (or are both padding).

    ``additive_dtype``: eager attention's additive form instead (0 where allowed, the dtype's lowest
    value elsewhere)."""
    same = (segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)).unsqueeze(1)
    if additive_dtype is None:
        return same
    return torch.zeros(same.shape, dtype=additive_dtype, device=same.device).masked_fill(
        ~same, torch.finfo(additive_dtype).min
    )


def _rows_attention(base: str) -> Any:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.bert.modeling_bert import eager_attention_forward

    def attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        bert_mp_cu_seqlens: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        kernel = None if bert_mp_cu_seqlens is None else varlen_kernel(query, dropout, base)
        if kernel is None:
            fn = ALL_ATTENTION_FUNCTIONS.get_interface(base, eager_attention_forward)
            return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        rows, heads, length, dim = query.shape
        q, k, v = (x.transpose(1, 2).reshape(rows * length, heads, dim) for x in (query, key, value))
        extra = {} if scaling is None else {"scale": scaling}
        cu = bert_mp_cu_seqlens
        out = kernel(q, k, v, cu, cu, length, length, **extra)
        return out.view(rows, length, heads, dim), None

    return attention


def varlen_kernel(query: torch.Tensor, dropout: float, base: str) -> Any:
    """The varlen kernel where it applies to these rows (:func:`bert_mp.model.unpad.flash_varlen_kernel`'s
    rules), else None (the block-diagonal mask). Tests replace it to check the route on a CPU."""
    return flash_varlen_kernel(query, dropout, base)


def install_rows_attention(model: nn.Module) -> str:
    """Route ``model``'s attention through the function that takes the varlen route where it can;
    returns its name. Idempotent; calls without ``cu_seqlens`` reach the current kernel unchanged."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    base = model.config._attn_implementation
    if base.startswith(PREFIX):
        return base
    name = PREFIX + base
    AttentionInterface.register(name, _rows_attention(base))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    model.set_attn_implementation(name)
    return name


def rows_route(device: torch.device | str, half: bool, attention_dropout: float, kernel: str) -> str:
    """The route a training step takes (recorded in summary.json): ``varlen`` or ``block_diagonal``."""
    probe = torch.empty(0, device=device, dtype=torch.bfloat16 if half else torch.float32)
    usable = kernel in ("auto", "flash") and varlen_kernel(probe, attention_dropout, "sdpa") is not None
    return "varlen" if usable else "block_diagonal"


def run_rows(
    wrapper: nn.Module,
    input_ids: torch.Tensor,
    token_type_ids: torch.Tensor,
    segment_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cls_index: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``PretrainingModel``'s encoder call on token-budget rows: the ``(rows x L, hidden)`` token states
    and the pooled ``[CLS]`` of every NSP slot."""
    bert = wrapper.model.bert
    kernel = getattr(wrapper, "attention_kernel", "auto")
    base = bert.config._attn_implementation.removeprefix(PREFIX).removeprefix("bert_mp_fast_dropout_")
    hidden = bert.embeddings(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids)
    mask = block_diagonal_mask(segment_ids, hidden.dtype if base == "eager" else None)
    installed = bert.config._attn_implementation.startswith(PREFIX)
    varlen = installed and kernel in ("auto", "flash") and cu_seqlens is not None
    kwargs = {"bert_mp_cu_seqlens": cu_seqlens} if varlen else {}
    with attention_backends(kernel):
        hidden = bert.encoder(hidden, attention_mask=mask, **kwargs).last_hidden_state
    hidden = hidden.reshape(-1, hidden.shape[-1])
    pooled = None
    if bert.pooler is not None:
        pooled = bert.pooler(hidden.index_select(0, cls_index).unsqueeze(1))
    return hidden, pooled
