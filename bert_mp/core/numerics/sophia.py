"""The Sophia optimizer of ``train.optimizer=sophia``: pytorch-optimizer's SophiaH fed with the
Hessian estimates :class:`bert_mp.core.numerics.hessian.HessianEstimator` takes (imported only when chosen)."""

from __future__ import annotations

from typing import Any

import torch
from pytorch_optimizer import SophiaH


class Sophia(SophiaH):
    """SophiaH that never estimates inside ``step``: it takes :attr:`pending_hessian` when one is set."""

    takes_pending_hessian = True  # what HessianEstimator.for_optimizer looks for

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.pending_hessian: list[torch.Tensor] | None = None

    @torch.no_grad()
    def step(self, closure: Any = None, hessian: list[torch.Tensor] | None = None) -> Any:
        fresh = hessian if hessian is not None else self.pending_hessian
        self.pending_hessian = None
        params = [p for g in self.param_groups for p in g["params"]]
        if fresh is None:  # no new estimate: the moving average is lerped towards itself (unchanged)
            fresh = [self.state[p].get("hessian_moment", torch.zeros_like(p)) for p in params]
        # in the moving average's dtype (bf16_pure's step hooks lift weights and states to fp32)
        fresh = [h.to(p.dtype) for h, p in zip(fresh, params)]
        out = super().step(closure, hessian=fresh)
        for p in params:  # the estimate is folded into hessian_moment; do not keep (or checkpoint) it
            self.state[p].pop("hessian", None)
        return out
