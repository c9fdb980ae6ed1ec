"""The update both training loops run after a backward: unscale (fp16), clip, step, zero the gradients,
and tell whether the GradScaler skipped the step.

The engine's side (Accelerate's clipping, FSDP2's sharded norm, DeepSpeed's clipping inside its step)
is :func:`bert_mp.core.engine.gradients.clip_grad_norm`.
"""

from __future__ import annotations

from typing import Any

import torch

from bert_mp.core.engine.gradients import clip_grad_norm
from bert_mp.core.numerics.precision import accelerate_unscales


def unscale_gradients(accelerator: Any, optimizer: Any) -> None:
    """Unscale fp16 gradients before clipping / measuring their norm.

    Accelerate unscales inside ``clip_grad_norm_`` only for its own native amp (CUDA); for our CPU
    scaler we do it here, once per step.
    """
    scaler = accelerator.scaler
    if scaler is None or accelerate_unscales(accelerator):
        return
    inner = getattr(optimizer, "optimizer", optimizer)
    scaler.unscale_(inner)


def optimizer_step(
    accelerator: Any, optimizer: Any, parameters: Any, max_grad_norm: float, scaler: Any
) -> tuple[Any, bool]:
    """Unscale (fp16), clip, step and zero the gradients; returns ``(grad_norm, skipped)``.

    ``skipped`` is true when the GradScaler found inf/NaN gradients and skipped the step: it lowers
    its scale exactly then. (Accelerate's ``optimizer_step_was_skipped`` misses it for fused AdamW,
    which skips inside its kernel.) ``grad_norm`` may be None where the engine clips itself.
    """
    unscale_gradients(accelerator, optimizer)
    grad_norm = clip_grad_norm(accelerator, parameters, max_grad_norm)
    # The scale is compared on the device and read back once (``get_scale()`` twice would be two syncs).
    scale_before = _scale_tensor(scaler)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    skipped = scale_before is not None and bool(_scale_tensor(scaler) < scale_before)
    return grad_norm, skipped


def _scale_tensor(scaler: Any) -> torch.Tensor | None:
    """The GradScaler's current scale as a tensor copy (no host read), None without an active scaler."""
    if scaler is None or not scaler.is_enabled():
        return None
    scale = getattr(scaler, "_scale", None)
    if torch.is_tensor(scale):
        return scale.detach().clone()
    return torch.tensor(float(scaler.get_scale()))
