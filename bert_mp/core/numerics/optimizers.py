"""The optimizer (AdamW, LAMB, Sophia, StableAdamW, Lion) over BERT's no-decay groups, and warmup +
linear / polynomial / constant schedules.

``train.optimizer`` picks the library: AdamW is torch's; LAMB and Sophia (SophiaH) come from
pytorch-optimizer, StableAdamW and Lion from torch-optimi. Under ``precision=bf16_pure`` the weights
are bf16 and ``bf16_update`` decides how updates reach them: torch-optimi's own Kahan summation
where the optimizer has it (adamw, stable_adamw, lion), :mod:`bert_mp.core.numerics.bf16_updates`'s step hooks
otherwise (stochastic rounding, and ``none``: round to nearest, where small updates vanish; the hooks
measure how much of each update reached the weights). fp16 needs nothing of the optimizer: the
GradScaler unscales before the step and skips it on overflow, whatever the optimizer.

The update both loops run after a backward (unscale, clip, step) is :mod:`bert_mp.core.loop.update`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from bert_mp.core.config import LoopConfig, TrainConfig

# Parameters named like these are LayerNorm weights; they and every bias get no weight decay.
_NO_DECAY_NAMES = ("LayerNorm.weight", "layer_norm.weight", "norm.weight")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices with weight decay; biases and LayerNorm weights without."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name.endswith("bias") or name.endswith(_NO_DECAY_NAMES) or p.ndim < 2:
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def fused_supported(device: torch.device) -> bool:
    """Whether torch's fused AdamW kernel runs on this device type."""
    if "fused" not in inspect.signature(torch.optim.AdamW).parameters:
        return False
    probe = torch.zeros(1, device=device, requires_grad=True)
    try:
        opt = torch.optim.AdamW([probe], fused=True)
        probe.grad = torch.zeros_like(probe)
        opt.step()
    except (RuntimeError, ValueError):
        return False
    return True


_OPTIMI_KAHAN = ("adamw", "stable_adamw", "lion")
"""Optimizers whose torch-optimi implementation has Kahan summation built in."""


def build_optimizer(model: nn.Module, cfg: LoopConfig, device: torch.device) -> torch.optim.Optimizer:
    """``cfg.optimizer`` over :func:`param_groups`, with the bf16 update of ``bf16_pure`` installed.

    AdamW in fp32 storage is torch's, fused when asked for and supported on ``device``.
    """
    pure = cfg.precision == "bf16_pure"
    update = cfg.bf16_update if pure else None
    native_kahan = update == "kahan" and cfg.optimizer in _OPTIMI_KAHAN
    groups = param_groups(model, cfg.weight_decay)
    opt = _OPTIMIZER_BUILDERS[cfg.optimizer](groups, cfg, torch.device(device), pure, native_kahan)
    if pure and not native_kahan:  # also for none: round to nearest, with the stall measured
        from bert_mp.core.numerics.bf16_updates import install_bf16_update

        install_bf16_update(opt, update, cfg.seed)
    return opt


def optimi_kernel(device: torch.device, foreach: bool) -> dict[str, bool]:
    """torch-optimi's implementation, stated rather than left to its default: its Triton kernel (the
    whole update of a tensor, Kahan summation included, in one launch) on a GPU where Triton runs and
    bf16 is supported; elsewhere ``foreach`` as given, else its per-tensor for-loop.

    optimi 0.3's own default looks a parameter's type up in ``torch.utils._foreach_utils``'s list,
    which holds ``torch.Tensor`` but not ``nn.Parameter``: a model's parameters fall to the for-loop
    (one elementwise kernel per operation per tensor; the H200 profile's bf16_pure rows show it).
    """
    from optimi.utils import HAS_TRITON

    if device.type == "cuda" and HAS_TRITON and torch.cuda.is_bf16_supported():
        return {"triton": True, "foreach": False}
    return {"triton": False, "foreach": foreach}


def describe_optimizer(opt: Any) -> dict[str, Any]:
    """What runs the update (summary.json's ``optimizer``): the class, its library and the kernel
    path: ``fused``, ``triton``, ``foreach`` (multi-tensor), ``for-loop`` (one kernel per operation
    per tensor), or ``foreach where the tensors allow`` (a library that decides at each step).
    Wrappers (Accelerate's, DeepSpeed's) are looked through to the optimizer that updates."""
    while getattr(opt, "optimizer", None) is not None and opt.optimizer is not opt:
        opt = opt.optimizer
    group = opt.param_groups[0] if opt.param_groups else {}
    foreach = group.get("foreach")
    if group.get("fused"):
        kernel = "fused"
    elif group.get("triton"):
        kernel = "triton"
    else:
        if foreach is None and type(opt).__module__.startswith("torch.optim"):
            from torch.optim.optimizer import _default_to_fused_or_foreach

            params = [p for g in opt.param_groups for p in g["params"]]
            foreach = _default_to_fused_or_foreach(params, differentiable=False)[1]
        kernel = {True: "foreach", False: "for-loop"}.get(foreach, "foreach where the tensors allow")
    out: dict[str, Any] = {
        "class": type(opt).__name__,
        "library": type(opt).__module__.split(".")[0],
        "kernel": kernel,
    }
    if group.get("kahan_sum") is not None:
        out["kahan_sum"] = bool(group["kahan_sum"])
    return out


def _adamw(groups: list, cfg: LoopConfig, device: torch.device, pure: bool, kahan: bool) -> Any:
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    if kahan:
        import optimi

        kw = optimi_kernel(device, foreach=False)
        return optimi.AdamW(
            groups, lr=cfg.learning_rate, betas=betas, eps=cfg.adam_epsilon, kahan_sum=True, **kw
        )
    # bf16 weights: the per-tensor path (the lifted fp32 weight and bf16 states mix dtypes)
    fused = bool(cfg.fused_adamw and not pure and fused_supported(device))
    extra = {"foreach": False} if pure else {}
    return torch.optim.AdamW(
        groups, lr=cfg.learning_rate, betas=betas, eps=cfg.adam_epsilon, fused=fused or None, **extra
    )


def _optimi(cls_name: str) -> Callable[..., Any]:
    def build(groups: list, cfg: LoopConfig, device: torch.device, pure: bool, kahan: bool) -> Any:
        import optimi

        kw: dict[str, Any] = {"lr": cfg.learning_rate, "betas": (cfg.adam_beta1, cfg.adam_beta2)}
        if cls_name == "StableAdamW":
            kw["eps"] = cfg.adam_epsilon
        kw.update(optimi_kernel(device, foreach=not pure))
        return getattr(optimi, cls_name)(groups, kahan_sum=kahan, **kw)

    return build


def _lamb(groups: list, cfg: LoopConfig, device: torch.device, pure: bool, kahan: bool) -> Any:
    from pytorch_optimizer import Lamb

    # weight_decouple=False: the decay joins the Adam update before the trust ratio, as in BERT's LAMB
    return Lamb(
        groups,
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_epsilon,
        weight_decouple=False,
        foreach=False if pure else None,
    )


def _sophia(groups: list, cfg: LoopConfig, device: torch.device, pure: bool, kahan: bool) -> Any:
    from bert_mp.core.numerics.sophia import Sophia

    return Sophia(
        groups,
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.sophia_hessian_beta),
        p=cfg.sophia_rho,
        update_period=cfg.sophia_update_period,
        foreach=False if pure else None,
    )


_OPTIMIZER_BUILDERS: dict[str, Callable[..., Any]] = {
    "adamw": _adamw,
    "lamb": _lamb,
    "sophia": _sophia,
    "stable_adamw": _optimi("StableAdamW"),
    "lion": _optimi("Lion"),
}


@dataclass(frozen=True)
class Schedule:
    """Warmup then decay of the peak learning rate, over optimizer steps that were not skipped."""

    warmup_steps: int
    total_steps: int
    kind: str = "linear"
    """linear | polynomial | constant (after warmup)."""
    power: float = 1.0
    warmup_from_zero: bool = False
    """Warmup multiplier ``step / warmup`` (Hugging Face's linear schedule, fine-tuning) instead of
    BERT's ``(step + 1) / warmup`` (pretraining)."""

    @classmethod
    def from_train(cls, cfg: TrainConfig) -> Schedule:
        return cls(cfg.warmup_steps, cfg.max_steps, cfg.lr_schedule, cfg.lr_power)


def lr_lambda(schedule: Schedule | TrainConfig) -> Callable[[int], float]:
    """Multiplier of the peak learning rate after ``step`` optimizer steps."""
    s = schedule if isinstance(schedule, Schedule) else Schedule.from_train(schedule)
    warmup, total, kind, power = s.warmup_steps, s.total_steps, s.kind, s.power
    first = 0 if s.warmup_from_zero else 1

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + first) / warmup
        if kind == "constant":
            return 1.0
        remaining = max(0, total - step) / max(1, total - warmup)
        return remaining if kind == "linear" else remaining**power

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: Schedule | TrainConfig) -> LambdaLR:
    """Warmup then decay; stepped by the loop only after an optimizer step that was not skipped."""
    return LambdaLR(optimizer, lr_lambda(schedule))
