"""DeepSpeed and FSDP set-up that keeps bert_mp's step semantics (explicit batch sizes, autocast).

bert_mp's loop normalises the loss over the whole optimizer step itself, steps the optimizer once
per global batch and runs the forward under ``PrecisionPlan.autocast()`` with fp32 master weights.
Accelerate's defaults for both sharded engines differ, so these helpers adjust them before
``accelerator.prepare``:

- **DeepSpeed** (ZeRO 1/2/3): ``"auto"`` batch sizes cannot be resolved when ``prepare`` gets no
  DataLoader (Accelerate raises ``ValueError``), so :func:`deepspeed_config` writes explicit
  ``train_micro_batch_size_per_gpu`` / ``gradient_accumulation_steps`` / ``train_batch_size`` and
  ``gradient_clipping``. DeepSpeed's own ``bf16`` / ``fp16`` modes keep the *weights* in 16 bits
  (with an fp32 copy inside the optimizer) and fp16 brings DeepSpeed's loss scaler, so both stay
  off: the engine holds fp32 weights and bf16 comes from the loop's autocast, exactly as on one GPU.
  ``train.precision=fp16`` is refused under DeepSpeed (its GradScaler cannot drive the engine).
  The engine steps only at accumulation boundaries and must not divide the already step-normalised
  loss by the accumulation count (both in :mod:`.gradients`).
- **FSDP**: Accelerate turns ``mixed_precision=bf16`` into ``param_dtype = reduce_dtype = bf16``
  (bf16 sharded weights and gradient reductions). :func:`configure_fsdp` sets an fp32 policy, so
  sharded parameters, gradients and reductions stay fp32 and bf16/fp16 come from autocast.
"""

from __future__ import annotations

from typing import Any

import torch

from bert_mp.errors import ConfigError

ZERO_STAGES = (1, 2, 3)


def deepspeed_config(
    micro_batch_size: int,
    accumulation: int,
    world_size: int,
    max_grad_norm: float,
    zero_stage: int = 2,
) -> dict[str, Any]:
    """A DeepSpeed config with every batch number explicit (no ``"auto"``) for bert_mp's loop."""
    if zero_stage not in ZERO_STAGES:
        raise ConfigError(f"DeepSpeed zero_stage must be one of {ZERO_STAGES} (got {zero_stage})")
    for name, v in (
        ("micro_batch_size", micro_batch_size),
        ("accumulation", accumulation),
        ("world", world_size),
    ):
        if int(v) < 1:
            raise ConfigError(f"DeepSpeed config: {name} must be >= 1 (got {v})")
    return {
        "train_micro_batch_size_per_gpu": int(micro_batch_size),
        "gradient_accumulation_steps": int(accumulation),
        "train_batch_size": int(micro_batch_size) * int(accumulation) * int(world_size),
        "gradient_clipping": float(max_grad_norm) if max_grad_norm > 0 else 0.0,
        "zero_optimization": {
            "stage": int(zero_stage),
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": True,
        },
        # the loop's own torch optimizer (AdamW, ...): its update is elementwise, so ZeRO's partitions of
        # its state update alike; DeepSpeed refuses an optimizer it did not build without this
        "zero_allow_untested_optimizer": True,
        # 16-bit *weights* off: bf16 is the loop's autocast over fp32 weights (fp32 master copy)
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def validate_deepspeed_config(ds: dict[str, Any]) -> None:
    """The checks DeepSpeed makes at start-up that matter here, so a bad config fails before any work."""

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else k)
        elif node == "auto":
            raise ConfigError(
                f"DeepSpeed config {path}='auto' cannot be resolved: bert_mp prepares no DataLoader"
            )

    walk(ds, "")
    micro, gas, total = (
        ds.get("train_micro_batch_size_per_gpu"),
        ds.get("gradient_accumulation_steps"),
        ds.get("train_batch_size"),
    )
    if not all(isinstance(x, int) and x > 0 for x in (micro, gas, total)):
        raise ConfigError(
            f"DeepSpeed config needs positive integer batch sizes (got {micro}, {gas}, {total})"
        )
    if total % (micro * gas):
        raise ConfigError(
            f"DeepSpeed train_batch_size={total} is not micro ({micro}) x accumulation ({gas}) x processes"
        )
    if ds.get("bf16", {}).get("enabled") and ds.get("fp16", {}).get("enabled"):
        raise ConfigError("DeepSpeed config enables both bf16 and fp16")
    if ds.get("zero_optimization", {}).get("stage", 0) not in (0, *ZERO_STAGES):
        raise ConfigError(
            f"DeepSpeed zero_optimization.stage must be 0-3 (got {ds['zero_optimization']['stage']})"
        )


def _state(accelerator: Any) -> Any:
    return getattr(accelerator, "state", None)


def uses_deepspeed(accelerator: Any) -> bool:
    return getattr(_state(accelerator), "deepspeed_plugin", None) is not None


def uses_fsdp(accelerator: Any) -> bool:
    return getattr(_state(accelerator), "fsdp_plugin", None) is not None


def accelerate_mixed_precision(plan: Any, distributed_type: str, key: str = "train.precision") -> str:
    """``Accelerator(mixed_precision=...)`` for a plan: ``"no"`` under DeepSpeed (the loop autocasts;
    DeepSpeed's bf16/fp16 would mean 16-bit weights), the plan's value otherwise. ``key`` names the
    loop's precision key in the error."""
    if distributed_type.upper().endswith("DEEPSPEED"):
        if getattr(plan, "use_scaler", False):
            raise ConfigError(
                f"{key}=fp16 is not supported under DeepSpeed (its fp16 mode keeps fp16 weights "
                f"and its own loss scaler); use {key}=bf16 or a DDP/FSDP config"
            )
        return "no"
    return plan.accelerate_mixed_precision


def configure_deepspeed(accelerator: Any, cfg: Any, accumulation: int) -> dict[str, Any] | None:
    """Before ``prepare``: replace the DeepSpeed plugin's config batch/precision fields with explicit
    values from ``cfg.train`` (keeps the ZeRO settings of the Accelerate YAML). None without DeepSpeed."""
    if not uses_deepspeed(accelerator):
        return None
    plugin = accelerator.state.deepspeed_plugin
    stage = int(plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 2) or 2)
    ours = deepspeed_config(
        cfg.train.micro_batch_size, accumulation, accelerator.num_processes, cfg.train.max_grad_norm, stage
    )
    ds = plugin.deepspeed_config
    zero = {**ds.get("zero_optimization", {}), **ours.pop("zero_optimization")}
    ds.update(ours)
    ds["zero_optimization"] = {k: v for k, v in zero.items() if v != "auto"}
    validate_deepspeed_config(ds)
    return ds


def configure_fsdp(accelerator: Any) -> None:
    """Before ``prepare``: FSDP keeps fp32 sharded parameters and fp32 reductions (autocast does the
    16-bit math), instead of Accelerate's bf16/fp16 ``param_dtype`` / ``reduce_dtype``."""
    if uses_fsdp(accelerator):
        accelerator.state.fsdp_plugin.set_mixed_precision(torch.float32, override=True)
