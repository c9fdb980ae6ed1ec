"""``bert-mp train``: pretrain ``BertForPreTraining`` with Accelerate under fp32 / tf32 / bf16 / fp16.

The loop's skeleton and its set-up sequence are :mod:`bert_mp.core.loop`; :class:`Trainer` supplies
pretraining's parts: its pieces of the set-up (data, model wrap, engine settings, callbacks), the
loader, the step (:mod:`.step`), the device-side step metrics and their flush, evaluation, and the
end of a finished run (final evaluation, save, export).

Semantics worth knowing:

- A step is ``global_batch_size`` sequences: ``accumulation = global / (micro x ranks)`` micro-batches
  per rank, losses normalised over the whole step (see :mod:`.step`).
- Data order is a permutation seeded by ``(train.seed, epoch)``; each step takes the next
  ``global_batch_size`` indices and every rank its slice, and the collator masks each example by
  ``(seed, epoch, index)``. The position ``(epoch, batch_in_epoch)`` is checkpointed, so a resume
  continues mid-epoch with the very same batches.
- fp16: a step whose gradients overflow is skipped by the GradScaler; it advances neither the
  scheduler nor ``step``. Too many in a row (or a non-finite loss in fp32/tf32/bf16) saves a
  checkpoint and stops with ``TrainingError``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from bert_mp.core.checkpoint import store as ckpt
from bert_mp.core.config import Config
from bert_mp.core.engine.distributed import configure_deepspeed, configure_fsdp
from bert_mp.core.loop.run_log import clean
from bert_mp.core.loop.skeleton import TrainingLoop
from bert_mp.core.loop.state import (  # the exit codes are re-exported: `bert-mp train`'s own
    STOP_EXIT_CODES,  # noqa: F401
    STOPPED_EXIT_CODE,  # noqa: F401
    BatchGeometry,
    exit_code,
    outcome_line,
)
from bert_mp.core.numerics.optimizers import build_scheduler, describe_optimizer
from bert_mp.core.numerics.step_scalars import DeviceStepMetrics
from bert_mp.core.process import console
from bert_mp.data.fingerprint import same_data
from bert_mp.errors import DataError
from bert_mp.model.attention import resolve_attention_kernel
from bert_mp.model.bert import (
    PretrainingModel,
    build_model,
    compile_counters,
    compile_model,
    drop_full_attention_mask,
    parameter_counts,
    static_mask_cap,
)
from bert_mp.model.dropout import install_fast_dropout, resolve_dropout_impl
from bert_mp.pretrain.batches import IndexedSplit, MicroBatchSampler, TokenBudgetSampler, example_lengths
from bert_mp.pretrain.data_check import check_resume_data, data_change_error
from bert_mp.pretrain.device_feed import loader_kwargs
from bert_mp.pretrain.evaluate import evaluate
from bert_mp.pretrain.export import pretraining_facts
from bert_mp.pretrain.monitors import PretrainContext, StepFacts, build_callbacks
from bert_mp.pretrain.step import StepTotals, device_scalar, forward_backward

if TYPE_CHECKING:
    from bert_mp.core.config import TrainConfig
    from bert_mp.data.masking import PretrainingCollator
    from bert_mp.data.prepare.cache import PreparedData

ModelBuilder = Callable[..., Any]
"""``build_model(model_cfg, vocab_size=, tokenizer_size=, max_seq_length=, pad_token_id=)``."""


def grad_norm_row(grad_norm: Any, like: torch.Tensor) -> torch.Tensor:
    """The gradient norm as a 1-element tensor beside the step totals (NaN where the engine clips)."""
    if grad_norm is None:
        return torch.full((1,), float("nan"), dtype=like.dtype, device=like.device)
    if not torch.is_tensor(grad_norm):  # a host number (some engines): filled in, not copied
        return torch.full((1,), float(grad_norm), dtype=like.dtype, device=like.device)
    return grad_norm.to(dtype=like.dtype, device=like.device).reshape(1)


def syncs_each_step(metrics_sync: str, device: torch.device) -> bool:
    """``train.metrics_sync``: read every step (``step``), at log points (``log``); auto: log on CUDA only,
    where a read stalls the host, and every step elsewhere, where it costs nothing."""
    if metrics_sync == "auto":
        return device.type != "cuda"
    return metrics_sync == "step"


class Trainer(TrainingLoop):
    """One pretraining run over the shared loop skeleton (:class:`bert_mp.core.loop.skeleton.TrainingLoop`).
    ``build_model`` is the seam for tests that inject faults into the model."""

    command = "train"
    tc: TrainConfig
    data: PreparedData | None
    """The prepared data; None until :meth:`load_data` prepares (or reuses) it from the config."""
    warmup_key = "warmup_steps"
    model_factory: ModelBuilder
    train_ds: Any
    val_ds: Any
    dropout_impl: str
    inner: Any
    """The unwrapped ``BertForPreTraining`` (its config and parameter counts)."""
    counts: dict[str, int]
    sync_each_step: bool
    """Read the step's totals every step (``train.metrics_sync``) rather than at log points."""
    pending: DeviceStepMetrics
    collator: PretrainingCollator
    sampler: MicroBatchSampler | TokenBudgetSampler
    batches: Iterator[dict]
    ctx: PretrainContext
    summary_start: dict[str, Any]
    """summary.json's pretraining fields known at the start (model, batch, data), and ``export``."""
    t_prev: float
    """When the last step read ended: step time excludes evaluation and checkpoint time."""

    def __init__(self, cfg: Config, data: Any = None, build_model: ModelBuilder = build_model):
        super().__init__(cfg, cfg.train)
        self.tc, self.data = cfg.train, data
        self.model_factory = build_model
        self.total_steps = self.final_eval_step = cfg.train.max_steps

    # ---- set-up: the pieces of the shared sequence (bert_mp.core.loop.setup) ----------------------
    def batch_geometry(self, processes: int) -> BatchGeometry:
        tc = self.tc
        return BatchGeometry.build(
            tc.global_batch_size,
            tc.micro_batch_size,
            processes,
            "train.global_batch_size",
            "train.micro_batch_size",
        )

    def load_data(self) -> None:
        if (
            self.data is None and self.tc.prepared
        ):  # several prepared folders (e.g. the shares of a split prepare)
            from bert_mp.data.prepare import load_prepared_shares

            self.data = load_prepared_shares(self.tc.prepared, self.cfg.data)
        if self.data is None:
            from bert_mp.data.prepare import load_prepared, prepare

            with self.accelerator.main_process_first():
                self.data = load_prepared(prepare(self.cfg))
        self.verify_data()
        self.train_ds, self.val_ds = self.data.dataset["train"], self.data.dataset["validation"]
        if len(self.train_ds) < self.tc.global_batch_size:
            raise DataError(
                f"the train split has {len(self.train_ds)} examples, fewer than train.global_batch_size="
                f"{self.tc.global_batch_size}; prepare more data or lower the batch size"
            )

    def verify_data(self) -> None:
        """Every prepared folder read checked against its recorded checksums before the first step
        (one line each, with the time it took): on each machine's first process, the others waiting."""
        from bert_mp.data.prepare.cache import verify_prepared

        if not self.data.path:  # data handed in by a caller (tests, benchmarks): nothing on disk
            return
        with self.accelerator.local_main_process_first():
            if self.accelerator.is_local_main_process:
                for folder in self.data.stats.get("shares") or [self.data.path]:
                    console.say(verify_prepared(folder), command="train")

    def build_model(self) -> Any:
        stats, tokenizer = self.data.stats, self.data.tokenizer
        return self.model_factory(
            self.cfg.model,
            vocab_size=int(stats["model_vocab_size"]),
            tokenizer_size=int(stats.get("tokenizer_size", len(tokenizer))),
            max_seq_length=int(stats.get("max_seq_length", self.cfg.data.max_seq_length)),
            pad_token_id=int(tokenizer.pad_token_id or 0),
        )

    def wrap_model(self, model: Any) -> Any:
        """Fast dropout, the masked-only MLM head and attention kernel, compiled where asked."""
        cfg, tc, device = self.cfg, self.tc, self.accelerator.device
        self.dropout_impl = resolve_dropout_impl(cfg.model.dropout_impl, device, tc.compile != "none")
        if self.dropout_impl == "fast":
            install_fast_dropout(model)
        self.inner, self.counts = model, parameter_counts(model)
        wrapped = PretrainingModel(
            model,
            cfg.model.sparse_mlm_head,
            max_predictions_per_seq=static_mask_cap(cfg.data, device),
            unpad=cfg.model.unpad,
            attention_kernel=resolve_attention_kernel(cfg.model.attention_kernel, device),
            token_budget=cfg.data.token_budget,
        )
        if tc.compile != "none":
            from bert_mp.model.unpad import prepare_for_compile

            prepare_for_compile(wrapped, cfg.data)  # fixed-size gathers, bucketed streams: bounded graphs
        self.compile_start = compile_counters()  # this run's graphs and breaks: the difference at its end
        # on CPU, inductor's scatter-adds run in a fixed order, so compiled runs resume bit-identically
        return compile_model(
            wrapped, tc.compile, deterministic=device.type == "cpu", compile_mode=tc.compile_mode
        )

    def build_scheduler(self, optimizer: Any) -> Any:
        return build_scheduler(optimizer, self.tc)

    def configure_engine(self) -> None:
        configure_deepspeed(self.accelerator, self.cfg, self.geometry.accumulation)  # explicit batch sizes
        configure_fsdp(self.accelerator)  # fp32 sharded parameters and reductions, autocast for 16-bit math

    def build_callbacks(self) -> list[Any]:
        """``train.callbacks``, and the buffer of device-side step metrics they are fed from."""
        tc = self.tc
        self.sync_each_step = syncs_each_step(tc.metrics_sync, self.accelerator.device)
        self.pending = DeviceStepMetrics(keys=(*StepTotals.names(), "grad_norm"), log_every=tc.log_every)
        return build_callbacks(self.cfg)

    def set_up(self) -> None:
        """The shared sequence; the checkpoints then record the data's fingerprint (a resume compares it)."""
        super().set_up()
        self.checkpointer.meta = {"data_fingerprint": self.data.stats.get("fingerprint")}

    def check_run_folder(self) -> None:
        """The shared run-folder check, then: a resume onto rebuilt prepared data is refused."""
        super().check_run_folder()
        check_resume_data(self.cfg, self.tc, self.resume_folder)

    # ---- restore and load --------------------------------------------------------------------------
    def restore(self) -> None:
        """The shared restore, then: a resume onto rebuilt prepared data is refused unless allowed."""
        super().restore()
        trained_on = self.checkpointer.restored_meta.get("data_fingerprint")
        now = self.checkpointer.meta["data_fingerprint"]
        form = self.data.stats.get("fingerprint_hash")
        if not self.tc.allow_data_change and not same_data(trained_on, self.data.path, now, form):
            raise data_change_error(self.resumed_from, trained_on, self.data.path, now)

    def build_loader(self) -> None:
        """Micro-batches from the checkpointed data position on, collated (and masked) by key."""
        from bert_mp.data.masking import PretrainingCollator

        tc, acc = self.tc, self.accelerator
        layout = None
        if self.cfg.model.unpad:  # the unpadded layout computed with the batch, not on the device
            from bert_mp.model.unpad import collate_layout

            layout = collate_layout(acc.unwrap_model(self.model))
        g = self.geometry
        self.collator = PretrainingCollator(
            self.data.tokenizer,
            self.cfg.data,
            seed=tc.seed,
            pad_to_multiple_of=8,
            layout=layout,
            budget_rows=g.micro_batch,
        )
        if tc.compile != "none":  # a few padded lengths only: a bounded number of compiled graphs
            from bert_mp.model.buckets import collate_length

            self.collator.static_length = collate_length(self.cfg.data.max_seq_length, self.cfg.model.unpad)
        self.sampler = self.build_sampler()
        loader = DataLoader(
            IndexedSplit(self.train_ds),
            batch_sampler=self.sampler,
            collate_fn=self.collator,
            **loader_kwargs(tc.num_workers, tc.pin_memory, acc.device),
            # A private generator: creating a loader iterator must not draw from the global RNG, or a
            # resumed run's dropout stream would differ from an uninterrupted one.
            generator=torch.Generator(),
        )
        self.batches = iter(loader)

    def build_sampler(self) -> MicroBatchSampler | TokenBudgetSampler:
        """This rank's micro-batches from the checkpointed data position: ``global_batch_size`` examples a
        step, or (``data.token_budget``) ``global_batch_size`` rows filled with whole examples."""
        tc, s, g, rank = self.tc, self.state, self.geometry, self.accelerator.process_index
        if self.cfg.data.token_budget:
            return TokenBudgetSampler(
                example_lengths(self.train_ds),
                g.micro_batch,
                self.cfg.data.max_seq_length,
                g.accumulation,
                rank,
                g.world,
                tc.seed,
                (s.epoch, s.data_offset, s.batch_in_epoch),
            )
        n = len(self.train_ds)
        return MicroBatchSampler(
            n, g.global_batch, g.micro_batch, rank, g.world, tc.seed, s.epoch, s.batch_in_epoch
        )

    def start(self) -> None:
        """Build the loader, then the shared start (log, callbacks, clock, progress bar)."""
        self.build_loader()
        super().start()
        self.t_prev = time.perf_counter()

    def on_start(self) -> None:
        """Start the callbacks with what they may read about the run."""
        self.ctx = self.start_callbacks(
            PretrainContext,
            param_counts=self.counts,
            hidden_size=self.inner.config.hidden_size,
            num_layers=self.inner.config.num_hidden_layers,
            vocab_size=self.inner.config.vocab_size,
        )
        self.summary_start = self.initial_summary()

    def bar_label(self) -> str:
        return f"train {self.plan.name}"

    def initial_summary(self) -> dict:
        g, inner = self.geometry, self.inner
        return {
            "model": {
                "preset": self.cfg.model.preset,
                "config": inner.config.to_diff_dict(),
                "parameters": self.counts,
                "dropout_impl": self.dropout_impl,
                "attn_implementation": inner.config._attn_implementation,
                "attention_kernel": self.accelerator.unwrap_model(self.model).attention_kernel,
            },
            "optimizer": describe_optimizer(self.optimizer),
            "batch": {
                "global": g.global_batch,
                "micro": g.micro_batch,
                "processes": g.world,
                "accumulation": g.accumulation,
            },
            "data": {
                "path": str(getattr(self.data, "path", "")),
                "fingerprint": self.data.stats.get("fingerprint"),
                "train_examples": len(self.train_ds),
                "validation_examples": len(self.val_ds),
                "token_budget": self.token_budget_record(),
            },
        }

    def token_budget_record(self) -> dict | None:
        """``data.token_budget``'s fixed shape and the attention route its training steps take."""
        if not self.cfg.data.token_budget:
            return None
        from bert_mp.data.packing import examples_per_row
        from bert_mp.model.rows import rows_route

        plan, length = self.plan, self.cfg.data.max_seq_length
        half = plan.autocast_dtype in (torch.bfloat16, torch.float16) or plan.param_dtype == torch.bfloat16
        kernel = self.accelerator.unwrap_model(self.model).attention_kernel
        return {
            "rows": self.geometry.micro_batch,
            "max_seq_length": length,
            "examples_per_row": examples_per_row(length),
            "attention": rows_route(
                self.accelerator.device, half, self.cfg.model.attention_probs_dropout_prob, kernel
            ),
        }

    # ---- one step ----------------------------------------------------------------------------------
    def train_step(self) -> None:
        """Forward/backward, guard, optimizer step; then record, evaluate and save when due."""
        s = self.state
        wait = time.perf_counter()
        micro = [next(self.batches) for _ in range(self.geometry.accumulation)]
        wait = time.perf_counter() - wait
        local = forward_backward(self.model, micro, self.accelerator, self.plan, self.geometry.per_rank)
        local["stop_flag"] = device_scalar(self.stop_flag(), self.accelerator.device)
        reduced = StepTotals.reduce(local, self.accelerator)  # stays on the device
        stop = False
        if self.sync_each_step:  # read now: a non-finite loss stops before its optimizer step
            totals = StepTotals.read(reduced)
            self.guard.check_loss(totals.loss, s, self.save_discarding_gradients)
            stop = totals.stop_flag  # above 0: some rank got a signal (which one: loop.flag_signal)
        elif self.geometry.world == 1:  # one rank: the signal is known on the host
            stop = s.pending_signal is not None
        # consumed after the loss check: a save for a non-finite loss resumes at this batch, one at the
        # skip limit (in the update) after it
        self.sampler.advance(s)
        lr, grad_norm, skipped = self.update(stop, micro[0])
        if skipped:
            return
        row = torch.cat([reduced, grad_norm_row(grad_norm, reduced)])
        self.pending.record(s.step, row, {"lr": lr, "wait": wait})
        self.log.progress(1)
        if self.sync_each_step or self.pending.should_flush(s.step):
            self.flush()
        if self.tc.eval_every and s.step % self.tc.eval_every == 0 and s.step < self.tc.max_steps:
            self.evaluate()
            self.t_prev = time.perf_counter()  # evaluation time is not step time
        if self.checkpointer.due(s.step):
            self.save()
            self.t_prev = time.perf_counter()  # checkpoint time is not step time

    def hessian_loss(self, batch: dict) -> Callable[[], torch.Tensor]:
        """One micro-batch's loss for Sophia's Hutchinson estimate (see :mod:`bert_mp.core.numerics.hessian`)."""
        device = self.accelerator.device
        batch = {k: v.to(device) for k, v in drop_full_attention_mask(batch).items()}

        def loss() -> torch.Tensor:
            with self.plan.autocast():
                o = self.model(**batch)
            return o["mlm_loss_sum"] / o["mlm_count"].clamp(min=1) + o["nsp_loss_sum"] / o["nsp_count"].clamp(
                min=1
            )

        return loss

    def flush(self) -> None:
        """Read the pending steps back (one device sync) and hand each to the guard, callbacks and log.

        The wall time since the last read is shared evenly by the steps read: with
        ``metrics_sync=log`` the host runs ahead of the device, so only the window's total is real.
        """
        rows = self.pending.flush()
        if not rows:
            return
        now = time.perf_counter()
        step_time = (now - self.t_prev) / len(rows)
        self.t_prev = now
        s, real_step = self.state, self.state.step
        try:
            for row in rows:
                totals = StepTotals.from_values(row[k] for k in StepTotals.names())
                self.guard.check_logged_loss(
                    totals.loss, row["step"], real_step, self.checkpointer.last_saved
                )
                s.step = row["step"]
                s.tokens_seen += int(totals.tokens)
                if totals.stop_flag > 0:
                    self.stop_for_signal(totals.stop_flag)
                self.record_step(totals, row, step_time)
        finally:
            s.step = real_step

    def record_step(self, totals: StepTotals, row: dict, step_time: float) -> None:
        """Hand one step's facts to the callbacks, then write what they logged."""
        s, tc = self.state, self.tc
        grad_norm = row["grad_norm"]
        facts = StepFacts(
            **totals.sums(),
            tokens=int(totals.tokens),
            padded_tokens=int(totals.padded_tokens),
            attention_flops_tokens=totals.attention_flops_tokens,
            sequences=int(totals.sequences),  # also without NSP labels (objective=mlm)
            lr=row["lr"],
            grad_norm=grad_norm,
            step_time_s=step_time,
            data_wait_s=row["wait"],
        )
        logs: dict = {"step": s.step, "kind": "train"}
        for cb in self.callbacks:
            cb.on_step_end(s, facts, logs)
        self.log.write(logs)
        if s.step % tc.log_every == 0 or s.step == tc.max_steps:
            self.log.track(logs, s.step)
            postfix = {
                "loss": f"{logs.get('loss/total', totals.loss):.3f}",
                "mlm_acc": f"{logs.get('accuracy/mlm', 0.0):.3f}",
                "tok_s": f"{logs.get('throughput/tokens_per_sec', 0.0):.0f}",
            }
            self.log.progress(0, **postfix)

    # ---- evaluate, save, finish --------------------------------------------------------------------
    def evaluate(self) -> dict:
        self.flush()
        acc = self.accelerator
        logs = {
            "step": self.state.step,
            "kind": "eval",
            **evaluate(self.model, self.val_ds, self.collator, self.cfg, acc, self.plan),
        }
        for cb in self.callbacks:
            cb.on_eval_end(self.state, logs)
        self.log.write(logs)
        nsp = logs.get("eval/accuracy_nsp")
        self.log.say(
            f"bert-mp train: step {self.state.step} eval: MLM loss {logs['eval/loss_mlm']:.4f}, "
            f"MLM accuracy {logs['eval/accuracy_mlm']:.3f}"
            + (f", NSP accuracy {nsp:.3f}" if nsp is not None else "")
        )
        self.log.track(logs, self.state.step)
        return logs

    def complete(self) -> dict:
        """A finished run evaluates, saves and exports."""
        final_eval = self.evaluate()
        self.save()
        if self.tc.export:
            out = Path(self.tc.output_dir) / "final"
            facts = pretraining_facts(
                self.cfg, self.state.step, self.plan.name, final_eval, self.summary_start["data"]
            )
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[self.tc.export_dtype]
            ckpt.export_pretrained(self.accelerator, self.model, self.data.tokenizer, out, facts, dtype)
            self.summary_start["export"] = str(out)
        return self.finish("completed", final_eval=clean(final_eval))

    def summary_extras(self, final_eval: dict | None = None) -> dict:
        """Model, batch, data (and export), the run's time and tokens, the final evaluation, compile."""
        extras = {
            **self.summary_start,
            "elapsed_s": self.checkpointer.elapsed(),
            "final_eval": final_eval,
            "tokens_seen": self.state.tokens_seen,
        }
        if self.tc.compile != "none":
            now = compile_counters()
            extras["compile"] = {
                "mode": self.tc.compile,
                "compile_mode": self.tc.compile_mode,
                **{k: now[k] - self.compile_start[k] for k in now},
            }
        return extras

    def precision_record(self) -> dict:
        return self.ctx.precision  # as the callbacks were given it at the start


def train(cfg: Config, data: Any = None, *, build_model: ModelBuilder = build_model) -> dict:
    """Run ``bert-mp train`` for a loaded config; returns summary.json's content.

    ``data`` is a ``prepare.PreparedData``; None prepares (or reuses the cached) data from ``cfg``.
    """
    return Trainer(cfg, data, build_model=build_model).run()


def command(cfg: Config) -> int:
    """CLI entry: ``bert-mp train [CONFIG.yaml] [key=value ...]`` for the config the CLI loaded and checked."""
    summary = train(cfg)
    ev = summary["final_eval"]
    result = (
        f"final eval MLM loss {ev['eval/loss_mlm']:.4f}, MLM accuracy {ev['eval/accuracy_mlm']:.3f}"
        if ev
        else None
    )
    console.show(outcome_line("train", summary, cfg.train.output_dir, result))
    return exit_code(summary)
