"""The set-up sequence both training loops run, its order written once.

:func:`set_up` builds a :class:`~bert_mp.core.loop.skeleton.TrainingLoop`'s parts in this order:

1. the product's input checks (nothing built yet: a mistake costs no start-up);
2. the precision plan (the hardware check), then ``hardware.flush_denormal``;
3. the accelerator, the batch geometry over its processes, the distributed strategy in force (one
   line where the launch cannot give it) and the start-up line;
4. the product's data, then the run log;
5. the model (seeded), the precision's weight storage, the product's wrap, bert_mp's FSDP2 shards;
6. the optimizer, the product's scheduler, the scaler, the engine's settings, ``accelerator.prepare``;
7. Sophia's Hessian estimator, the objects checkpointed beside the model, the per-rank seed;
8. the callbacks, the checkpointer and the numerics guard.

A product supplies the pieces through the loop's hooks (``check_inputs``, ``batch_geometry``,
``load_data``, ``build_model``, ``wrap_model``, ``build_scheduler``, ``configure_engine``, ``prepare``,
``checkpointed``, ``build_callbacks``); nothing here knows pretraining or fine-tuning.
"""

from __future__ import annotations

from typing import Any

from bert_mp.core.engine.accelerator import build_accelerator, resolve_plan
from bert_mp.core.engine.strategy import resolve_strategy, shard
from bert_mp.core.loop.checkpoint_saver import Checkpointer
from bert_mp.core.loop.numerics_guard import NumericsGuard
from bert_mp.core.loop.run_log import RunLog
from bert_mp.core.numerics.hessian import HessianEstimator
from bert_mp.core.numerics.optimizers import build_optimizer
from bert_mp.core.numerics.precision import install_scaler
from bert_mp.core.numerics.subnormal import apply_flush_denormal
from bert_mp.core.process.conditions import announce_start


def set_up(loop: Any) -> None:
    """Build ``loop``'s parts in the order of the module docstring (``loop``: a ``TrainingLoop``)."""
    from accelerate.utils import set_seed

    cfg, section, command = loop.cfg, loop.section, loop.command
    log_with = list(getattr(section, "log_with", ()) or ())
    loop.check_inputs()
    loop.plan = resolve_plan(section, cfg.hardware.allow_emulated)
    apply_flush_denormal(cfg.hardware.flush_denormal)
    acc = loop.accelerator = build_accelerator(
        loop.plan, section.output_dir, log_with, key=f"{section.SECTION}.precision"
    )
    loop.geometry = loop.batch_geometry(acc.num_processes)
    loop.strategy = resolve_strategy(acc, section, command)  # before any work
    loop.conditions = announce_start(
        acc, command, loop.geometry.accumulation, loop.plan, strategy=loop.strategy.label()
    )
    loop.load_data()
    loop.log = RunLog(acc, cfg, section, log_with)
    set_seed(section.seed)  # the same initial weights on every rank
    model = loop.wrap_model(loop.plan.prepare_model(loop.build_model()))  # bf16_pure, fp8: storage
    model = shard(loop.strategy, model)  # FSDP on a CPU launch: before the optimizer sees parameters
    optimizer = build_optimizer(model, section, acc.device)
    loop.scheduler = loop.build_scheduler(optimizer)
    loop.scaler = install_scaler(acc, loop.plan)
    loop.configure_engine()
    loop.model, loop.optimizer = loop.prepare(model, optimizer)
    loop.hessian = HessianEstimator.for_optimizer(loop.optimizer, section)  # sophia only
    # The scheduler is stepped by hand (only after a real optimizer step), so it is not prepared -
    # only registered for checkpointing.
    acc.register_for_checkpointing(loop.scheduler, *loop.checkpointed())
    set_seed(section.seed + acc.process_index)  # dropout streams differ per rank
    loop.callbacks = loop.build_callbacks()
    loop.checkpointer = Checkpointer(acc, section, loop.total_steps, loop.callbacks)
    loop.guard = NumericsGuard.for_loop(section, loop.scaler, warmup_key=loop.warmup_key)
