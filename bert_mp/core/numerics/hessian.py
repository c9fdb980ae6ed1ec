"""Sophia (pytorch-optimizer's SophiaH) fed with Hutchinson Hessian estimates taken by the loop.

SophiaH can estimate the Hessian diagonal itself, but only from gradients built with
``backward(create_graph=True)`` - which would put every step's backward through a double-backward
graph, and under fp16 through the loss scale. Here the loop asks :class:`HessianEstimator` every
``sophia_update_period`` steps instead: one extra forward on the step's first micro-batch (dropout
off, the math attention kernel, which has a double backward), ``g = grad(loss * scale)`` with a
graph, then ``h = u * grad(g . u) / scale`` for a Gaussian ``u`` drawn from a generator seeded by
``(seed, step)``. Dividing by the loss scale gives the Hessian of the unscaled loss; an estimate that
is not finite (an fp16 overflow) is dropped, and the step keeps the previous moving average. Under
fp8 the estimate runs the float8 Linears as plain ones (float8 matmuls have no double backward).
Under DDP (several processes) the estimates of the ranks are averaged (:func:`mean_across_ranks`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch


class HessianEstimator:
    """When due, a Hutchinson estimate of the Hessian diagonal for the :class:`Sophia` under the loop."""

    def __init__(self, optimizer: Any, period: int, seed: int):
        self.sophia = _unwrap(optimizer)
        self.period, self.seed = period, seed
        self.taken = self.dropped = 0

    @classmethod
    def for_optimizer(cls, optimizer: Any, cfg: Any) -> HessianEstimator | None:
        """An estimator when ``optimizer`` is Sophia, else None."""
        # by marker, not isinstance: Sophia's module imports pytorch-optimizer, which a run
        # with another optimizer may not have (a GPU machine gets only what it is carried)
        if not getattr(_unwrap(optimizer), "takes_pending_hessian", False):
            return None
        return cls(optimizer, cfg.sophia_update_period, cfg.seed)

    def due(self, step: int) -> bool:
        return step % self.period == 0

    def estimate(
        self, model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor], step: int, scaler: Any = None
    ) -> bool:
        """Set the optimizer's next Hessian from ``loss_fn()`` (a scalar, computed under the plan's
        autocast); returns False when the estimate overflowed and was dropped."""
        params = [p for g in self.sophia.param_groups for p in g["params"]]
        scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0
        was_training = model.training
        model.eval()  # no dropout: the estimate is of the loss itself, and draws no dropout randomness
        try:
            with torch.enable_grad(), _math_attention(), _high_precision_linears(model):
                loss = loss_fn().float() * scale
                live = [p for p in params if p.requires_grad]
                grads = torch.autograd.grad(loss, live, create_graph=True, allow_unused=True)
                pairs = [(p, g) for p, g in zip(live, grads) if g is not None]
                gen = torch.Generator(device=params[0].device).manual_seed(self.seed * 1_000_003 + step)
                us = [torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) for p, _ in pairs]
                hvps = torch.autograd.grad(
                    [g for _, g in pairs], [p for p, _ in pairs], grad_outputs=us, allow_unused=True
                )
        finally:
            model.train(was_training)
        by_param = {
            id(p): (u * hv / scale).detach() if hv is not None else torch.zeros_like(p)
            for (p, _), u, hv in zip(pairs, us, hvps)
        }
        hessian = mean_across_ranks([by_param.get(id(p), torch.zeros_like(p)) for p in params])
        # one host read every sophia_update_period steps (after the mean: every rank decides alike)
        if not bool(torch.stack([h.float().abs().sum() for h in hessian]).isfinite().all()):
            self.dropped += 1
            return False
        self.sophia.pending_hessian = hessian
        self.taken += 1
        return True


def mean_across_ranks(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The element-wise mean of ``tensors`` over the processes of a replicated (DDP) run; as they are
    in a single process.

    ``torch.autograd.grad`` fires none of DDP's gradient hooks, so each rank's estimate comes from its
    own micro-batch only: Sophia would then clip each rank's update by a different Hessian and the
    replicas would drift apart. One all-reduce of the flattened estimates (fp32) every
    ``sophia_update_period`` steps keeps them equal; a non-finite estimate on any rank makes the mean
    non-finite on every rank, so all drop it together.
    """
    import torch.distributed as dist
    from accelerate.utils import reduce

    if not tensors or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return tensors
    flat = reduce(torch.cat([t.detach().reshape(-1).float() for t in tensors]), reduction="mean")
    out, start = [], 0
    for t in tensors:
        out.append(flat[start : start + t.numel()].view_as(t).to(t.dtype))
        start += t.numel()
    return out


def _unwrap(optimizer: Any) -> Any:
    return getattr(optimizer, "optimizer", optimizer)


@contextlib.contextmanager
def _high_precision_linears(model: torch.nn.Module) -> Any:
    """fp8: torchao's float8 matmuls have no double backward, so the estimate runs those Linears as
    plain ones on their master weights."""
    import torch.nn.functional as F

    swapped = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
    for m in swapped:
        m.forward = lambda x, m=m: F.linear(x, m.weight, m.bias)
    try:
        yield
    finally:
        for m in swapped:
            del m.forward


def _math_attention() -> contextlib.AbstractContextManager:
    """SDPA's math kernel: the fused kernels have no double backward."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # pragma: no cover - older torch
        return contextlib.nullcontext()
    return sdpa_kernel(SDPBackend.MATH)
