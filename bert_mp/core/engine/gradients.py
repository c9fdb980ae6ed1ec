"""The one adapter both training loops call for the engine's side of a step: the backward, the
accumulation boundary, and the gradient norm with clipping.

Accelerate's plain DDP, FSDP2 (bert_mp's ``fully_shard`` and Accelerate's) and DeepSpeed differ
here: DeepSpeed steps inside ``backward`` at the boundary and clips there itself, FSDP2's norm is a
sharded tensor, DDP synchronises gradients unless told not to. Products call these functions and
never branch on the engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from bert_mp.core.engine.distributed import uses_deepspeed


def backward(accelerator: Any, loss: Any) -> None:
    """``accelerator.backward``; under DeepSpeed the loss is already normalised over the whole step,
    so the engine must not divide it by the accumulation count again."""
    accelerator.backward(loss, **({"scale_wrt_gas": False} if uses_deepspeed(accelerator) else {}))


@contextlib.contextmanager
def micro_batch(accelerator: Any, model: Any, last: bool) -> Iterator[None]:
    """One micro-batch of an optimizer step: gradients are synchronised across ranks on the ``last``
    only, and Accelerate is told whether it ends the step - DeepSpeed's engine steps in ``backward``
    exactly then (bert_mp does not use ``accelerator.accumulate``)."""
    accelerator.gradient_state._set_sync_gradients(bool(last))
    with contextlib.nullcontext() if last else accelerator.no_sync(model):
        yield


def clip_grad_norm(accelerator: Any, parameters: Any, max_grad_norm: float) -> Any:
    """Clip to ``max_grad_norm`` (0: measure only) and return the norm before clipping, over every
    shard; None where the engine measured none."""
    max_norm = max_grad_norm if max_grad_norm > 0 else float("inf")
    grad_norm = accelerator.clip_grad_norm_(parameters, max_norm)
    if hasattr(grad_norm, "full_tensor"):  # sharded gradients (FSDP2): the norm over every shard
        grad_norm = grad_norm.full_tensor()
    if grad_norm is None:  # DeepSpeed clips inside its step, which ran in the backward
        grad_norm = engine_grad_norm(accelerator)
    return grad_norm


def engine_grad_norm(accelerator: Any) -> Any:
    """The gradient norm DeepSpeed's engine measured (before clipping) in the step it just took inside
    ``backward``; None without DeepSpeed or where the engine did not measure one."""
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if not uses_deepspeed(accelerator) or wrapped is None:
        return None
    norm = wrapped.engine.get_global_grad_norm()
    return None if norm is None else float(norm)
