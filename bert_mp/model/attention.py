"""``model.attention_kernel``: which fused attention kernel serves SDPA, chosen by name or by measurement.

torch's SDPA picks among its kernels (cuDNN, flash, memory-efficient, math) by a fixed priority and
what each supports (a padding mask rules flash out). ``auto`` keeps that priority unless another
kernel was measured faster on the device (:data:`ATTENTION_AUTO`, docs/gpu.md); a named kernel restricts SDPA
to it (its backward follows the forward's kernel). ``flash`` is torch's varlen flash kernel on the
unpadded stream (``bert_mp.model.unpad``), not an SDPA restriction.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

ATTENTION_AUTO: dict[str, str] = {}
"""``model.attention_kernel=auto`` per device (``cuda:sm90`` for Hopper): the kernel measured
fastest there (docs/gpu.md); a device not listed keeps torch's own priority."""


def attention_key(device: torch.device | str) -> str:
    """The :data:`ATTENTION_AUTO` key of a device: ``cuda:smXY`` or the device type."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(dev)
        return f"cuda:sm{major}{minor}"
    return dev.type


def resolve_attention_kernel(setting: str, device: torch.device | str) -> str:
    """``model.attention_kernel`` on ``device``: ``auto`` becomes the measured choice (or stays ``auto``:
    torch's priority); CUDA-only kernels are refused elsewhere, before training starts."""
    from bert_mp.errors import HardwareError

    dev = torch.device(device)
    if setting == "auto":
        return ATTENTION_AUTO.get(attention_key(dev), "auto")
    if setting in ("cudnn", "efficient") and dev.type != "cuda":
        raise HardwareError(
            f"model.attention_kernel={setting} is a CUDA kernel; on {dev.type} use auto, math or "
            "(with model.unpad=true) flash"
        )
    return setting


SDPA_BACKENDS = ("cudnn", "efficient", "math")
"""The ``model.attention_kernel`` values that restrict SDPA to one of its kernels."""


def attention_backends(kernel: str) -> Any:
    """A context that restricts SDPA to ``kernel`` (``cudnn | efficient | math``); ``auto`` and
    ``flash`` (the varlen kernel, not SDPA's) leave SDPA's choice alone. Its backward follows the
    forward's kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }.get(kernel)
    return contextlib.nullcontext() if backend is None else sdpa_kernel([backend])
