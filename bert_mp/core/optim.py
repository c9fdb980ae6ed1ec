"""AdamW with BERT's no-decay groups, and warmup + linear / polynomial / constant schedules."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

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


def build_optimizer(model: nn.Module, cfg: LoopConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups`, fused when asked for and supported on ``device``."""
    fused = bool(cfg.fused_adamw and fused_supported(torch.device(device)))
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_epsilon,
        fused=fused or None,
    )


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
