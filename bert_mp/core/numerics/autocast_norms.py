"""LayerNorm whose output stays in autocast's dtype: a 16-bit residual stream under autocast.

Autocast runs ``layer_norm`` in fp32 and returns fp32, so in a BERT layer the residual stream (each
LayerNorm's output, added to the next sub-layer's output) is fp32: every Linear that reads it casts it
to bf16 again, and every residual add, dropout and LayerNorm moves fp32 bytes. With
``layernorm_precision=autocast`` each LayerNorm still computes exactly what autocast computes (fp32
statistics and affine, fp32 parameters) and its output is rounded once to the autocast dtype, so the
stream between layers is bf16 (or fp16): no per-Linear input casts, half the bytes in the adds and
norms. Under ``torch.compile`` the round-trip fuses into the norm's kernel (reads 16-bit, writes 16-bit).

The swap changes the class of each ``nn.LayerNorm`` in place: parameters, state-dict keys, checkpoints
and the export are untouched, and outside autocast (an evaluation in fp32, an exported model) the
module is a plain LayerNorm.
"""

from __future__ import annotations

import torch
from torch import nn

LAYERNORM_PRECISIONS = ("auto", "fp32", "autocast")


class AutocastLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` computed as autocast computes it (fp32), its output in autocast's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        out = super().forward(x)  # under autocast: fp32 math on fp32 parameters, fp32 output
        if not torch.is_autocast_enabled(kind):
            return out
        return out.to(torch.get_autocast_dtype(kind))


def install_autocast_layernorm(model: nn.Module) -> int:
    """Give every plain ``nn.LayerNorm`` of ``model`` the 16-bit output; returns how many (idempotent)."""
    swapped = 0
    for module in model.modules():
        if type(module) is nn.LayerNorm:
            module.__class__ = AutocastLayerNorm
            swapped += 1
    return swapped
