"""Subnormal floats on CPU: flushing them to zero (``hardware.flush_denormal``) and counting them in a
run's weights and optimizer state.

An fp32 value below 2^-126 (1.2e-38) is subnormal; x86 CPUs compute with one through a microcode
slow path, tens of times slower. Optimizer states that decay towards zero (LAMB's and Sophia's
second moments over rarely-updated rows) fill with them, and a CPU run slows down for it, not for
its precision. Flush-to-zero and denormals-are-zero (``torch.set_flush_denormal``) make every such
result and input zero instead. The setting lives in each thread's floating-point control register:
threads started after it inherit it, those started before keep theirs, so it is set before torch's
thread pool starts (the CLI does it first) and :func:`flush_denormal` checks every thread.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

EFFECTS = ("on", "off", "partial", "unsupported")
"""What :func:`flush_denormal` found: every thread flushes, none does, some do (threads started
before the setting), or the CPU cannot (not x86 with SSE3)."""
_SET_HERE: list[bool] = []
"""Whether this module turned flushing on in this process (so that asking for off undoes only that)."""

# (integer view, exponent bits, mantissa bits) of the formats whose subnormals are fp32 subnormals on
# a CPU (bf16 is computed in fp32 there); fp16's own subnormals become normal fp32 values
_LAYOUT = {"float32": ("int32", 0x7F800000, 0x007FFFFF), "bfloat16": ("int16", 0x7F80, 0x007F)}


def flush_denormal(on: bool) -> str:
    """Flush subnormal floats to zero on torch's CPU threads (``on``), or leave them (``off``: undoes
    only this module's own setting); returns what is in effect afterwards, one of :data:`EFFECTS`."""
    import torch

    if on:
        if not torch.set_flush_denormal(True):
            return "unsupported"
        _SET_HERE[:] = [True]
    elif _SET_HERE:
        torch.set_flush_denormal(False)
        _SET_HERE.clear()
    return threads_flushing()


def apply_flush_denormal(asked: bool) -> str:
    """``hardware.flush_denormal`` for a training run: :func:`flush_denormal`, with a warning where
    flushing was asked for but does not hold on every thread. Returns what is in effect."""
    effect = flush_denormal(asked)
    if asked and effect != "on":
        import warnings

        from bert_mp.errors import BertMPWarning

        why = (
            "this CPU cannot flush them (not x86 with SSE3)"
            if effect == "unsupported"
            else "only some of torch's threads flush them: its thread pool started before the setting "
            "(the bert-mp CLI sets it first; from Python, call bert_mp.core.numerics.subnormal.flush_denormal(True) "
            "before any torch work)"
        )
        warnings.warn(
            BertMPWarning(f"hardware.flush_denormal=true: {why}; subnormals are kept"), stacklevel=2
        )
    return effect


def threads_flushing() -> str:
    """``on`` / ``off`` / ``partial``: whether torch's intra-op threads flush, read from one
    computation that underflows on every thread."""
    import torch

    threads = torch.get_num_threads()
    # 2^-70 squared is 2^-140, subnormal in fp32; each thread gets several grain-sized chunks
    x = torch.full((max(1, threads) * 65536,), 2.0**-70, dtype=torch.float32)
    flushed = int(((x * x).view(torch.int32) == 0).sum())
    if flushed == x.numel():
        return "on"
    return "off" if flushed == 0 else "partial"


def subnormal_share(tensors: Iterable[Any]) -> float | None:
    """The share of fp32 / bf16 values in ``tensors`` that are subnormal, read from their bits (so it
    is the same whether flushing is on or not); None when there are no such values. A sharded tensor
    (FSDP's DTensor) counts this rank's shard."""
    import torch

    total = subnormal = 0
    for t in tensors:
        if hasattr(t, "to_local"):  # a DTensor: its bits live in the local shard
            t = t.to_local()
        layout = _LAYOUT.get(str(t.dtype).removeprefix("torch."))
        if layout is None or t.numel() == 0:
            continue
        view, exponent, mantissa = layout
        bits = t.detach().reshape(-1).view(getattr(torch, view))
        subnormal += int((((bits & exponent) == 0) & ((bits & mantissa) != 0)).sum())
        total += t.numel()
    return subnormal / total if total else None


def state_tensors(model: Any, optimizer: Any) -> list[Any]:
    """A run's weights and optimizer state tensors (what an optimizer step reads every step)."""
    import torch

    parameters = getattr(model, "parameters", None)
    out = [p for p in parameters() if isinstance(p, torch.Tensor)] if callable(parameters) else []
    state = getattr(optimizer, "state", None) or {}
    for per_param in state.values():
        if isinstance(per_param, dict):
            out += [v for v in per_param.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return out
