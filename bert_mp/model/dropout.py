"""Dropout with cheaper random numbers, for CPU training (``model.dropout_impl``).

On CPU, ``torch.nn.functional.dropout`` draws one random number per element (``bernoulli_``):
about a quarter of a bf16 BERT step on the development box (profiled: 13 calls per ``mini``
step, ~250 ms of ~930 ms). Here one 64-bit draw of the same torch generator feeds four elements:
each keeps 15 of its 16 bits, and an element is kept when they are at least
``round(p * 32768)``. So the dropout probability in effect is ``p`` rounded to a multiple of
1/32768 (0.1 becomes 0.100006), and the survivors are scaled by ``1 / (1 - that)``, which keeps
the expectation exact. The mask is made ~5x faster and saved for backward as one byte per element.

It replaces every ``nn.Dropout`` of the model and, through a registered attention function, the
dropout on attention probabilities, which ``BertSelfAttention`` otherwise hands to SDPA (whose
CPU math path draws with ``bernoulli_``). Outside training, or at p = 0, attention goes to the
configured kernel (``sdpa`` or ``eager``) untouched, so evaluation and the exported model are the
same as without it. The draws come from torch's default generator: seeded by the run seed and
saved in checkpoints, so runs and resumes stay reproducible. On CUDA the fused kernels draw from
Philox inside the kernel, so ``model.dropout_impl=auto`` uses this only on CPU.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

_BITS = 15
_ONE = 1 << _BITS
_LANE = (1 << _BITS) - 1


def effective_p(p: float) -> float:
    """The dropout probability in effect for a requested ``p`` (a multiple of 1/32768)."""
    return round(p * _ONE) / _ONE


def keep_mask(shape: torch.Size | tuple[int, ...], p: float, device: Any = None) -> torch.Tensor:
    """Boolean mask, True with probability ``1 - effective_p(p)`` per element, independent elements."""
    n = math.prod(shape)
    words = torch.empty(-(-n // 4), dtype=torch.int64, device=device).random_()
    # random_() on int64 fills [0, 2**63): the 16-bit lanes' low 15 bits are all uniform.
    lanes = words.view(torch.int16)[:n]
    return (lanes & _LANE).ge(round(p * _ONE)).view(shape)


class _MaskScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return x.mul(keep).mul_(scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (keep,) = ctx.saved_tensors
        return grad.mul(keep).mul_(ctx.scale), None, None


def fast_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Inverted dropout of ``x`` with :func:`keep_mask`; identity outside training or at p = 0."""
    q = effective_p(p)
    if not training or q == 0.0:
        return x
    if q >= 1.0:
        return x * 0.0
    return _MaskScale.apply(x, keep_mask(x.shape, p, x.device), 1.0 / (1.0 - q))


class FastDropout(nn.Dropout):
    """``nn.Dropout`` (same ``p``, same place in the module tree) drawing masks with :func:`keep_mask`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fast_dropout(x, self.p, self.training)


def _attention_with_fast_dropout(base: str):
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
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not module.training or effective_p(dropout) == 0.0:
            fn = ALL_ATTENTION_FUNCTIONS.get_interface(base, eager_attention_forward)
            return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=0.0, **kwargs)
        # The eager computation (scores in the autocast dtype, softmax in fp32 under autocast)
        # with the fast mask on the probabilities.
        if scaling is None:
            scaling = query.size(-1) ** -0.5
        weights = torch.matmul(query, key.transpose(2, 3)) * scaling
        if attention_mask is not None and attention_mask.dtype == torch.bool:  # sdpa's form: True = attend
            weights = weights.masked_fill(~attention_mask, torch.finfo(weights.dtype).min)
        elif attention_mask is not None:  # eager's form: additive
            weights = weights + attention_mask
        weights = fast_dropout(nn.functional.softmax(weights, dim=-1), dropout)
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights

    return attention


def attention_name(base: str) -> str:
    """The registered attention implementation that adds fast dropout to ``base`` (sdpa / eager)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = f"bert_mp_fast_dropout_{base}"
    AttentionInterface.register(name, _attention_with_fast_dropout(base))
    # the padding mask is built as for the base kernel (the training path takes both forms)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


def install_fast_dropout(model: nn.Module) -> int:
    """Swap every ``nn.Dropout`` in ``model`` for :class:`FastDropout` and route attention through
    the fast-dropout attention function. Parameters, state-dict keys and the saved config are
    unchanged (``config.json`` does not record the attention implementation). Returns how many
    dropout modules were swapped."""
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Dropout:
                setattr(module, name, FastDropout(child.p, child.inplace).train(child.training))
                swapped += 1
    base = model.config._attn_implementation
    if not base.startswith("bert_mp_fast_dropout_"):
        model.set_attn_implementation(attention_name(base))
    return swapped


def resolve_dropout_impl(setting: str, device: torch.device, compiled: bool = False) -> str:
    """``auto`` -> ``fast`` on an uncompiled CPU run, ``torch`` elsewhere; ``torch`` / ``fast`` as given.

    Under ``train.compile`` ``auto`` is ``torch``: inductor draws torch's dropout masks inside its fused
    kernels, while the fast masks (an in-place ``random_`` of a buffer) break the graph at every
    dropout.

    ``fast`` is refused off the CPU: on CUDA torch's fused kernels already draw their masks inside the
    kernel, and the fast path would route attention through an eager, materialised score matrix.
    """
    if setting == "auto":
        return "fast" if device.type == "cpu" and not compiled else "torch"
    if setting == "fast" and device.type != "cpu":
        from bert_mp.errors import HardwareError

        raise HardwareError(
            f"model.dropout_impl=fast is a CPU speed-up; on {device.type} it would replace the fused "
            "attention kernel with an eager one. Use model.dropout_impl=auto or torch."
        )
    return setting
