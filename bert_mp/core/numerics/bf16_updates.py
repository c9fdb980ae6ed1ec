"""Updates of bf16 weights without an fp32 master copy: Kahan-compensated or stochastically rounded.

A bf16 weight has 8 significant bits: an update smaller than half its spacing rounds away, so naive
bf16 training stalls once the learning rate decays. Two remedies (Zamirai et al. 2020, arXiv
2010.06192):

- Kahan summation keeps each weight's rounding error in a bf16 compensation buffer and adds it back
  before the next update (torch-optimi implements it inside AdamW, StableAdamW and Lion);
- stochastic rounding rounds up or down with probability proportional to the distance, so updates
  survive in expectation.

:func:`install_bf16_update` gives *any* ``torch.optim.Optimizer`` either remedy through step hooks:
before the step each bf16 weight (plus its compensation), its gradient and its states are lifted to
fp32, the optimizer computes and applies its update in fp32, and after the step the weight is
rounded back to bf16 (nearest, keeping the residual; or stochastically) and the rest stored as bf16
again. The fp32 copies exist only during the step (a transient peak of the size of fp32 optimizer
state); what persists is bf16 weights, gradients, states and (Kahan) one bf16 buffer per weight.
"""

from __future__ import annotations

from typing import Any

import torch

BF16_UPDATE_MODES = ("kahan", "stochastic", "none")
COMP_KEY = "bf16_kahan_comp"
"""Optimizer-state key of a weight's Kahan compensation (checkpointed with the optimizer)."""


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """fp32 -> bf16, rounding up with probability equal to the dropped fraction of the spacing.

    Adds uniform random bits below bf16's 16 kept bits of the fp32 pattern, then truncates.
    """
    bits = x.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, generator=generator, device=bits.device, dtype=torch.int32)
    rounded = (bits + noise) & -65536  # 0xFFFF0000 as a signed int32: keep sign, exponent, 7 mantissa bits
    return rounded.view(torch.float32).to(torch.bfloat16)


class Bf16UpdateHooks:
    """Step pre/post hooks that make an optimizer's updates of bf16 weights compensated or stochastic."""

    def __init__(self, optimizer: torch.optim.Optimizer, mode: str, seed: int = 0):
        assert mode in BF16_UPDATE_MODES, mode
        self.optimizer, self.mode, self.seed = optimizer, mode, seed
        self.lifted: list[torch.Tensor] = []
        self.before_step: list[torch.Tensor] = []
        self.efficiency: torch.Tensor | None = None
        """Last step's share of the optimizer's update that reached the weights (see :meth:`after`)."""

    def _params(self) -> list[torch.Tensor]:
        return [
            p
            for g in self.optimizer.param_groups
            for p in g["params"]
            if p.grad is not None and p.dtype == torch.bfloat16
        ]

    @torch.no_grad()
    def before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.lifted = []
        for p in self._params():
            lifted = p.data.float()
            state = optimizer.state[p]
            if self.mode == "kahan" and COMP_KEY in state:
                lifted += state[COMP_KEY].float()
            self.lifted.append(p)
            self.before_step.append(lifted.clone())
            p.data, p.grad = lifted, p.grad.float()
            for k, v in state.items():  # the step's arithmetic in fp32, on the bf16-stored states
                if k != COMP_KEY and _is_moment(v, p):
                    state[k] = v.float()

    @torch.no_grad()
    def after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        gen = None
        if self.mode == "stochastic" and self.lifted:
            # one stream per (seed, step): a resumed run rounds exactly as an uninterrupted one
            gen = torch.Generator(device=self.lifted[0].device)
            gen.manual_seed(self.seed * 1_000_003 + self._step_number())
        dot = norm = None
        for p, old in zip(self.lifted, self.before_step):
            new = p.data
            kept = None
            if self.mode == "stochastic":
                rounded = stochastic_round_bf16(new, gen)
            else:
                rounded = new.to(torch.bfloat16)
            if self.mode == "kahan":
                kept = (new - rounded.float()).to(torch.bfloat16)
                optimizer.state[p][COMP_KEY] = kept
            # the update that reached the weight (with the kept residual) against the one computed
            intended = new - old
            reached = rounded.float() - old + (kept.float() if kept is not None else 0.0)
            d, n = (reached * intended).sum(), (intended * intended).sum()
            dot, norm = (d, n) if dot is None else (dot + d, norm + n)
            p.data, p.grad = rounded, p.grad.to(torch.bfloat16)
            _states_to_bf16(optimizer.state[p], p)
        if dot is not None:
            self.efficiency = dot / norm.clamp(min=torch.finfo(torch.float32).tiny)
        self.lifted, self.before_step = [], []

    def _step_number(self) -> int:
        """Steps taken by this optimizer (from its state, so it survives a checkpoint)."""
        state = self.optimizer.state
        first = next((p for g in self.optimizer.param_groups for p in g["params"]), None)
        n = state.get(first, {}).get("bf16_update_steps") if first is not None else None
        n = int(n.item()) if torch.is_tensor(n) else 0
        if first is not None:
            state[first]["bf16_update_steps"] = torch.tensor(n + 1)
        return n


def _is_moment(v: Any, p: torch.Tensor) -> bool:
    """A per-element optimizer state of ``p`` (moments, Hessian average), as opposed to step counters."""
    return torch.is_tensor(v) and v.is_floating_point() and v.shape == p.shape


def _states_to_bf16(state: dict, p: torch.Tensor) -> None:
    """States computed in fp32 during the step go back to bf16 storage."""
    for k, v in state.items():
        if _is_moment(v, p):
            state[k] = v.to(torch.bfloat16)


_latest: list[Bf16UpdateHooks] = []


def install_bf16_update(optimizer: torch.optim.Optimizer, mode: str, seed: int = 0) -> Bf16UpdateHooks:
    """Hook ``optimizer`` so its updates of bf16 weights are ``kahan``, ``stochastic`` or ``none``
    (round to nearest); each step measures :attr:`Bf16UpdateHooks.efficiency`."""
    hooks = Bf16UpdateHooks(optimizer, mode, seed)
    optimizer.register_step_pre_hook(hooks.before)
    optimizer.register_step_post_hook(hooks.after)
    _latest[:] = [hooks]  # what the loop's monitor reads (one training loop per process at a time)
    return hooks


def update_efficiency_logs() -> dict[str, float]:
    """``bf16/update_efficiency`` of the last step of this process's bf16_pure optimizer (empty
    without one): the projection of the update that reached the bf16 weights (plus Kahan's kept
    residual) on the update the optimizer computed, over its squared norm. About 1 when updates
    survive (Kahan; stochastic rounding in expectation), near 0 when they round away (a stall)."""
    if not _latest or _latest[0].efficiency is None:
        return {}
    return {"bf16/update_efficiency": float(_latest[0].efficiency)}
