"""Pretraining's monitors: throughput and MFU, MLM / NSP loss, and the registry ``train.callbacks`` names.

The pretraining loop hands each callback the raw facts of an optimizer step (a :class:`StepFacts`:
loss sums and counts over all micro-batches and ranks, token counts, wall times); turning them into
metrics - MFU included - is the monitors' job. The protocol, the callback state in checkpoints and
the monitors fine-tuning shares (memory, loss scale) are :mod:`bert_mp.core.loop.callbacks`.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any

import torch

from bert_mp.core.loop.callbacks import (
    BaseCallback,
    Callback,
    LoopStepFacts,
    LossScaleMonitor,
    MemoryMonitor,
    TrainContext,
)
from bert_mp.core.loop.state import LoopState
from bert_mp.errors import ConfigError


@dataclass
class LossSums:
    """MLM and NSP loss sums, correct predictions and counts (what ``PretrainingModel`` returns)."""

    mlm_loss_sum: float
    mlm_correct: float
    mlm_count: float
    nsp_loss_sum: float
    nsp_correct: float
    nsp_count: float


@dataclass
class StepFacts(LossSums, LoopStepFacts):
    """Raw facts of one pretraining step, summed over its micro-batches and all ranks."""

    tokens: int
    """Non-padding tokens."""
    padded_tokens: int
    """Positions computed including padding (sequences x padded length)."""
    attention_flops_tokens: float
    """Sum over sequences of real_length^2 (:func:`attention_flops_tokens`), consistent with ``tokens``."""
    sequences: int
    data_wait_s: float
    """Time this rank spent waiting for batches."""


@dataclass(kw_only=True)
class PretrainContext(TrainContext):
    """:class:`TrainContext` plus the model's shape, for the FLOPs of a step."""

    param_counts: dict
    """``model.parameter_counts()``."""
    hidden_size: int
    num_layers: int
    vocab_size: int


# --------------------------------------------------------------------------------------------------
# FLOPs and peak table
# --------------------------------------------------------------------------------------------------
# Dense peak FLOP/s per device and precision (vendor datasheets; sparsity figures halved). fp32 is the
# CUDA-core rate; tf32/bf16/fp16 are tensor-core rates. Matched on the whole normalised device name
# (see peak_flops): "L4" must not match "L40", an H100 NVL or PCIe must not get SXM peaks. Unknown
# devices (and CPUs) give MFU None, printed as n/a.
_HOPPER_SXM = {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12}
_HOPPER_PCIE = {"fp32": 51e12, "tf32": 378e12, "bf16": 756e12, "fp16": 756e12}
_HOPPER_NVL = {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "fp16": 835.5e12}
_AMPERE_A100 = {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    (r"h100 nvl", _HOPPER_NVL),
    (r"h100 pcie( \d+gb)?", _HOPPER_PCIE),
    (r"h100( sxm\d?)?( \d+gb)?( hbm\d)?", _HOPPER_SXM),
    (r"h800 pcie( \d+gb)?", _HOPPER_PCIE),
    (r"h800( sxm\d?)?( \d+gb)?( hbm\d)?", _HOPPER_SXM),
    (r"h200 nvl", _HOPPER_NVL),
    (r"h200( sxm\d?)?( \d+gb)?( hbm\d e?)?", _HOPPER_SXM),
    (r"gh200( \d+gb)?( hbm\d e?)?", _HOPPER_SXM),
    (r"h20", {"fp32": 44e12, "tf32": 74e12, "bf16": 148e12, "fp16": 148e12}),
    (r"b200", {"fp32": 75e12, "tf32": 1100e12, "bf16": 2250e12, "fp16": 2250e12}),
    (r"a100([- ]sxm4| pcie|-pcie)?([- ]\d+gb)?( pcie)?", _AMPERE_A100),
    (r"a800([- ]sxm4| pcie|-pcie)?([- ]\d+gb)?( pcie)?", _AMPERE_A100),
    (r"l40s", {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362e12, "fp16": 362e12}),
    (r"l40", {"fp32": 90.5e12, "tf32": 90.5e12, "bf16": 181e12, "fp16": 181e12}),
    (r"l4", {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12}),
    (r"a10g", {"fp32": 31.2e12, "tf32": 35e12, "bf16": 70e12, "fp16": 70e12}),
    (r"a10", {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12}),
    (r"v100([- ]sxm2)?([- ]\d+gb)?", {"fp32": 15.7e12, "fp16": 125e12}),
]


def normalise_device_name(device_name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"h100 80gb hbm3"``: vendor prefixes off, lower case, single spaces."""
    name = " ".join(device_name.strip().lower().split())
    for prefix in ("nvidia ", "tesla "):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def peak_flops(device_name: str, precision: str) -> float | None:
    """Per-device peak FLOP/s for ``precision``, or None when the device is not in the table.

    The whole normalised name must match one pattern (no substring matching).
    """
    name = normalise_device_name(device_name)
    for pattern, table in PEAK_FLOPS:
        if re.fullmatch(pattern, name):
            return table.get(precision)
    return None


def attention_flops_tokens(attention_mask: torch.Tensor, segment_ids: torch.Tensor | None = None) -> float:
    """Sum over sequences of (real length)^2, the attention term of :func:`step_flops`.

    Counted on real tokens, like the linear layers: MFU measures useful work, so padding (which a
    padded SDPA kernel also computes) is not credited. With ``segment_ids`` (packed rows: 1, 2, ... per
    example, 0 on padding) each example of a row is a sequence of its own, as it attends only within
    itself. The same count for the padded, unpadded and packed paths. Call it on the CPU batch.
    """
    if segment_ids is None:
        lengths = attention_mask.sum(dim=1, dtype=torch.float64)
    else:
        rows = torch.arange(segment_ids.shape[0]).unsqueeze(1) * (int(segment_ids.max()) + 1)
        lengths = torch.bincount((rows + segment_ids)[attention_mask != 0]).to(torch.float64)
    return float((lengths * lengths).sum())


def step_flops(facts: StepFacts, ctx: PretrainContext) -> float:
    """Training FLOPs of a step: 6 x matmul params x tokens + attention; MLM head only where it ran."""
    pc, h = ctx.param_counts, ctx.hidden_size
    encoder = 6 * pc["encoder_matmul"] * facts.tokens
    # QK^T and AV: 2 x 2 x seq x hidden per token per layer forward, x3 for backward
    attention = 12 * ctx.num_layers * h * facts.attention_flops_tokens
    sparse = getattr(ctx.cfg.model, "sparse_mlm_head", True)
    dense_rows = facts.tokens if getattr(ctx.cfg.model, "unpad", False) else facts.padded_tokens
    mlm_rows = facts.mlm_count if sparse else dense_rows
    mlm = 6 * (pc["mlm_transform_matmul"] + pc["mlm_decoder_matmul"]) * mlm_rows
    nsp = 6 * (pc["pooler_matmul"] + pc["nsp_matmul"]) * facts.sequences
    return float(encoder + attention + mlm + nsp)


# --------------------------------------------------------------------------------------------------
# monitors
# --------------------------------------------------------------------------------------------------
class ThroughputMonitor(BaseCallback):
    """Tokens/s (non-padding), positions/s (padding included: what the matmuls ran on), sequences/s, step
    ms, the model's FLOP/s and MFU (that over the device's datasheet peak), data-wait fraction.

    Step times are wall-clock between reads of the step metrics, shared evenly by the steps read
    (every step, or every ``log_every`` steps with ``train.metrics_sync=log``); a read waits for the
    device, so the time of each window, and the run's average, is exact.
    """

    name = "throughput"

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.warmup_steps = max(2, cfg.train.max_steps // 10)
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.positions: list[int] = []
        self.seqs: list[int] = []
        self.flops: list[float] = []
        self.peak: float | None = None

    def on_train_start(self, state: LoopState, ctx: TrainContext) -> None:
        super().on_train_start(state, ctx)
        per_device = peak_flops(ctx.precision.get("device_name", ""), ctx.precision.get("name", ""))
        self.peak = per_device * ctx.num_processes if per_device else None

    def on_step_end(self, state: LoopState, facts: StepFacts, logs: dict) -> None:
        f, ctx = facts, self.ctx
        assert isinstance(ctx, PretrainContext)
        dt = max(f.step_time_s, 1e-9)
        flops = step_flops(f, ctx)
        logs["time/step_ms"] = 1000.0 * dt
        logs["throughput/tokens_per_sec"] = f.tokens / dt
        logs["throughput/positions_per_sec"] = f.padded_tokens / dt
        logs["throughput/seqs_per_sec"] = f.sequences / dt
        logs["throughput/flops_per_sec"] = flops / dt  # the model's FLOPs (step_flops), any device
        logs["throughput/mfu"] = flops / dt / self.peak if self.peak else None
        logs["data/wait_fraction"] = min(1.0, f.data_wait_s / dt)
        self.times.append(dt)
        self.tokens.append(f.tokens)
        self.positions.append(f.padded_tokens)
        self.seqs.append(f.sequences)
        self.flops.append(flops)

    def state_dict(self) -> dict:
        return {
            "times": self.times,
            "tokens": self.tokens,
            "positions": self.positions,
            "seqs": self.seqs,
            "flops": self.flops,
        }

    def load_state_dict(self, d: dict) -> None:
        self.times, self.tokens = list(d["times"]), list(d["tokens"])
        self.seqs, self.flops = list(d["seqs"]), list(d["flops"])
        # a checkpoint from before positions were kept: its steps count as unknown (0)
        self.positions = list(d.get("positions", [0] * len(self.times)))

    def on_train_end(self, state: LoopState, summary: dict) -> None:
        skip = self.warmup_steps if len(self.times) > self.warmup_steps else 0
        t = sum(self.times[skip:])
        if not t:
            summary["throughput"] = {"steps_measured": 0}
            return
        summary["throughput"] = {
            "steps_measured": len(self.times) - skip,
            "warmup_steps_excluded": skip,
            "tokens_per_sec": sum(self.tokens[skip:]) / t,
            "positions_per_sec": sum(self.positions[skip:]) / t,
            "seqs_per_sec": sum(self.seqs[skip:]) / t,
            "step_ms": 1000.0 * t / (len(self.times) - skip),
            "flops_per_sec": sum(self.flops[skip:]) / t,
            "mfu": sum(self.flops[skip:]) / t / self.peak if self.peak else None,
            "peak_flops": self.peak,
        }


class LossMonitor(BaseCallback):
    """MLM / NSP loss and accuracy, total loss, learning rate and gradient norm of every step.

    ``loss/nsp`` and ``accuracy/nsp`` are None when the step had no NSP labels (objective=mlm).
    """

    name = "loss"

    def on_step_end(self, state: LoopState, facts: StepFacts, logs: dict) -> None:
        f = facts
        mlm = f.mlm_loss_sum / max(f.mlm_count, 1.0)
        nsp = f.nsp_loss_sum / f.nsp_count if f.nsp_count else None
        logs["loss/total"] = mlm + (nsp or 0.0)
        logs["loss/mlm"] = mlm
        logs["loss/nsp"] = nsp
        logs["accuracy/mlm"] = f.mlm_correct / max(f.mlm_count, 1.0)
        logs["accuracy/nsp"] = f.nsp_correct / f.nsp_count if f.nsp_count else None
        logs["optim/lr"] = f.lr
        logs["optim/grad_norm"] = f.grad_norm


# --------------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------------
# name -> class or "module:Class" (imported lazily, so optional callbacks cost nothing unless used;
# the parity callback reads a reference run and is rarely on)
REGISTRY: dict[str, Any] = {
    "throughput": ThroughputMonitor,
    "loss": LossMonitor,
    "memory": MemoryMonitor,
    "loss_scale": LossScaleMonitor,
    "parity": "bert_mp.pretrain.parity_monitor:ParityCallback",
}


def build_callbacks(cfg: Any) -> list[Callback]:
    """Instantiate ``cfg.train.callbacks`` by name, in order, each with the full Config.

    Each gets its registry name as ``name``: the key of its state in checkpoints.
    """
    out: list[Callback] = []
    for name in cfg.train.callbacks:
        if name not in REGISTRY:
            raise ConfigError(f"train.callbacks: unknown callback {name!r}; known: {', '.join(REGISTRY)}")
        target = REGISTRY[name]
        if isinstance(target, str):
            module, cls = target.split(":")
            target = getattr(importlib.import_module(module), cls)
        cb = target(cfg)
        cb.name = name
        out.append(cb)
    return out
