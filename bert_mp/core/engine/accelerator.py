"""Accelerator set-up shared by every training loop: the precision plan first, then Accelerate."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from bert_mp.core.numerics.precision import PrecisionPlan, resolve_precision


def resolve_plan(cfg: Any, allow_emulated: bool = False) -> PrecisionPlan:
    """The precision plan of a loop section (``train`` or ``finetune``) on this process's device.

    Called before any data work, so a precision the hardware lacks fails at once (naming the
    section's key); ``allow_emulated`` is ``hardware.allow_emulated``.
    """
    from accelerate import PartialState

    from bert_mp.core.engine.strategy import launch_request, state_options

    # Without CUDA, say so explicitly: Accelerate then sets up gloo when launched with several
    # processes instead of silently running each of them as a world of one (DeepSpeed: gloo through
    # DeepSpeed's CPU accelerator, which cpu=True would drop).
    device = PartialState(**state_options(launch_request(), torch.cuda.is_available())).device
    return resolve_precision(
        cfg.precision,
        device,
        cfg.fp16_init_scale,
        cfg.fp16_growth_interval,
        allow_emulated=allow_emulated,
        key=f"{cfg.SECTION}.precision",
        bf16_update=cfg.bf16_update,
        fp8_recipe=cfg.fp8_recipe,
        fp8_convert_heads=cfg.fp8_convert_heads,
        layernorm=cfg.layernorm_precision,
        layernorm_key=f"{cfg.SECTION}.layernorm_precision",
    )


def build_accelerator(
    plan: PrecisionPlan, output_dir: str | Path, log_with: list[str] = (), key: str = "train.precision"
) -> Any:
    """An ``Accelerator`` for ``plan`` with trackers under ``<output_dir>/trackers``; backend flags set.
    ``key`` is the loop's precision key, named in a refusal."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import ProjectConfiguration

    from bert_mp.core.engine.distributed import accelerate_mixed_precision
    from bert_mp.core.engine.strategy import launch_request, state_options

    deepspeed_only_once_imported()
    out = Path(output_dir)
    options = state_options(launch_request(), torch.cuda.is_available())
    distributed_type = str(PartialState(**options).distributed_type)
    accelerator = Accelerator(
        cpu=options["cpu"],
        # under DeepSpeed "no": the loop autocasts over fp32 weights (DeepSpeed's bf16 means bf16 weights)
        mixed_precision=accelerate_mixed_precision(plan, distributed_type, key),
        log_with=list(log_with) or None,
        project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "trackers")),
        kwargs_handlers=plan.accelerate_kwargs_handlers(),
    )
    plan.apply_backend_flags()
    _warn_if_fewer_processes(accelerator.num_processes)
    return accelerator


def deepspeed_only_once_imported() -> None:
    """Accelerate's unwrapping (``unwrap_model``, ``get_state_dict``) imports DeepSpeed whenever it is
    installed, to test the model against ``DeepSpeedEngine``: 0.6-0.8 CPU s in every run that saves or
    exports, DeepSpeed or not. An engine exists only once ``deepspeed`` is imported
    (Accelerate imports it to build one), so its availability check, as that function reads it, is
    answered "not imported yet: no"; once imported, Accelerate's own answer. Idempotent; a no-op where
    Accelerate's module has no such name."""
    try:
        from accelerate.utils import other
    except ImportError:
        return
    found = getattr(other, "is_deepspeed_available", None)
    if found is None or hasattr(found, "__wrapped__"):
        return

    def is_deepspeed_available() -> bool:
        return "deepspeed" in sys.modules and found()

    is_deepspeed_available.__wrapped__ = found
    other.is_deepspeed_available = is_deepspeed_available


def _warn_if_fewer_processes(world: int) -> None:
    """A plain ``accelerate launch --num_processes N`` that started fewer processes says so."""
    import warnings

    from bert_mp.core.process.spawn import process_count_warning
    from bert_mp.errors import BertMPWarning

    message = process_count_warning(world)
    if message:
        warnings.warn(message, BertMPWarning, stacklevel=2)
