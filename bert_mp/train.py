"""``bert-mp train``: pretrain ``BertForPreTraining`` with Accelerate under fp32 / tf32 / bf16 / fp16.

One readable loop: build -> loop -> evaluate -> save. Precision comes from ``precision.py``, the
loss from ``model.PretrainingModel``, metrics from callbacks, checkpoints from ``checkpoint.py``.

Semantics worth knowing when reading the loop:

- A step is ``global_batch_size`` sequences: ``accumulation = global / (micro x ranks)`` micro-batches
  per rank. The MLM loss of the step is divided by the masked-token count of the *whole step* (all
  micro-batches, all ranks) and the NSP loss by its sequence count, so k micro-batches give exactly
  the gradient of one k-times larger batch.
- Data order is a permutation seeded by ``(train.seed, epoch)``; each step takes the next
  ``global_batch_size`` indices and every rank its slice, and the collator masks each example by
  ``(seed, epoch, index)``. The position ``(epoch, batch_in_epoch)`` is checkpointed, so a resume
  continues mid-epoch with the very same batches.
- fp16: a step whose gradients overflow is skipped by the GradScaler; it advances neither the
  scheduler nor ``step``. Too many in a row (or a non-finite loss in fp32/tf32/bf16) saves a
  checkpoint and stops with ``TrainingError``.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from bert_mp import checkpoint as ckpt
from bert_mp.callbacks import StepFacts, TrainContext, build_callbacks, finite_or_none
from bert_mp.config import Config, config_to_dict, load_config, save_config
from bert_mp.dropout import install_fast_dropout, resolve_dropout_impl
from bert_mp.errors import ConfigError, DataError, TrainingError
from bert_mp.io import JsonlWriter, atomic_write_json, read_jsonl
from bert_mp.model import PretrainingModel, build_model, parameter_counts
from bert_mp.optim import build_optimizer, build_scheduler
from bert_mp.precision import install_scaler, library_versions, optimizer_step, resolve_precision


@dataclass
class LoopState:
    """Everything the loop needs besides model/optimizer/RNG to continue exactly where it stopped."""

    step: int = 0
    """Optimizer steps done (skipped fp16 steps not counted)."""
    epoch: int = 0
    batch_in_epoch: int = 0
    """Global batches of ``epoch`` already consumed (skipped steps included)."""
    skipped_steps: int = 0
    consecutive_skips: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0
    stop_reason: str | None = None
    """Set by a callback (or a signal): the loop saves and stops after the current step."""
    pending_signal: str | None = None
    """A SIGTERM/SIGINT arrived; shared with every rank at the next step's all-reduce."""
    facts: StepFacts | None = None
    """The last step's raw facts, for callbacks (not checkpointed)."""

    def state_dict(self) -> dict:
        d = asdict(self)
        for k in ("facts", "stop_reason", "pending_signal"):
            d.pop(k)
        return d

    def load_state_dict(self, d: dict) -> None:
        for k, v in d.items():
            if k in ("facts", "stop_reason", "pending_signal") or not hasattr(self, k):
                continue
            setattr(self, k, v)


# --------------------------------------------------------------------------------------------------
# data order
# --------------------------------------------------------------------------------------------------
def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of a split's indices for one epoch, a function of (seed, epoch) only."""
    return np.random.default_rng([seed, epoch]).permutation(n)


class _Indexed(Dataset):
    """Split rows addressed by ``(epoch, index)``, with both added as features for the collator."""

    def __init__(self, ds: Any):
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        epoch, index = key
        row = dict(self.ds[int(index)])
        row["index"] = int(index)
        row["epoch"] = int(epoch)
        return row


class MicroBatchSampler:
    """Endless micro-batches of ``(epoch, index)`` keys for one rank, starting at a data position.

    Step ``b`` of epoch ``e`` uses ``epoch_order(e)[b*G:(b+1)*G]``; rank ``r`` takes its contiguous
    ``G / world`` slice and cuts it into micro-batches. The last partial global batch is dropped.
    """

    def __init__(
        self, n: int, global_bs: int, micro_bs: int, rank: int, world: int, seed: int, epoch: int, batch: int
    ):
        self.n, self.global_bs, self.micro_bs = n, global_bs, micro_bs
        self.rank, self.world, self.seed = rank, world, seed
        self.start = (epoch, batch)
        self.batches_per_epoch = n // global_bs

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch, first = self.start
        per_rank = self.global_bs // self.world
        while True:
            order = epoch_order(self.n, self.seed, epoch)
            for b in range(first, self.batches_per_epoch):
                mine = order[b * self.global_bs + self.rank * per_rank :][:per_rank]
                for i in range(0, per_rank, self.micro_bs):
                    yield [(epoch, int(j)) for j in mine[i : i + self.micro_bs]]
            epoch, first = epoch + 1, 0


# --------------------------------------------------------------------------------------------------
# signals
# --------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def stop_on_signals(state: LoopState) -> Iterator[None]:
    """SIGTERM / SIGINT ask the loop to save a checkpoint and stop after the current step."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        state.pending_signal = signal.Signals(signum).name

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


# --------------------------------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------------------------------
# fp16: gradients that overflow even unscaled (scale < 1) mean divergence, not a too-high scale; below
# this the scaler only shrinks the gradients into fp16 underflow and the run silently stops learning.
MIN_LOSS_SCALE = 1.0

_SUM_KEYS = ("mlm_loss_sum", "mlm_correct", "mlm_count", "nsp_loss_sum", "nsp_correct", "nsp_count")


@torch.no_grad()
def evaluate(model: Any, val_ds: Any, collator: Any, cfg: Config, accelerator: Any, plan: Any) -> dict:
    """MLM/NSP loss and accuracy and perplexity on the validation split (masking fixed: epoch 0)."""
    n, micro = len(val_ds), cfg.train.micro_batch_size
    n_batches = math.ceil(n / micro)
    if cfg.train.eval_max_batches:
        n_batches = min(n_batches, cfg.train.eval_max_batches)
    world, rank = accelerator.num_processes, accelerator.process_index
    sums = torch.zeros(len(_SUM_KEYS), dtype=torch.float64, device=accelerator.device)
    model.eval()
    # Every rank runs the same number of forwards (sharded models need all ranks in each one); a
    # rank without a batch of its own repeats batch 0 with weight 0.
    for r in range(math.ceil(n_batches / world)):
        b = r * world + rank
        weight = 1.0 if b < n_batches else 0.0
        b = b if b < n_batches else 0
        feats = []
        for i in range(b * micro, min(n, (b + 1) * micro)):
            row = dict(val_ds[i])
            row["index"], row["epoch"] = i, 0
            feats.append(row)
        batch = {k: v.to(accelerator.device) for k, v in collator(feats).items()}
        with plan.autocast():
            out = model(**batch)
        sums += weight * torch.stack([out[k].double() for k in _SUM_KEYS])
    model.train()
    s = accelerator.reduce(sums, reduction="sum").tolist()
    mlm = s[0] / max(s[2], 1.0)
    return {
        "eval/loss_mlm": mlm,
        "eval/loss_nsp": s[3] / s[5] if s[5] else None,  # None: no NSP labels (objective=mlm)
        "eval/accuracy_mlm": s[1] / max(s[2], 1.0),
        "eval/accuracy_nsp": s[4] / s[5] if s[5] else None,
        "eval/perplexity": math.exp(min(mlm, 80.0)),
        "eval/masked_tokens": int(s[2]),
    }


# --------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------
def _make_accelerator(cfg: Config) -> tuple[Any, Any]:
    from accelerate import Accelerator, PartialState
    from accelerate.utils import ProjectConfiguration

    # Without CUDA, say so explicitly: Accelerate then sets up gloo when launched with several
    # processes instead of silently running each of them as a world of one.
    cpu = not torch.cuda.is_available()
    device = PartialState(cpu=cpu).device
    plan = resolve_precision(
        cfg.train.precision, device, cfg.train.fp16_init_scale, cfg.train.fp16_growth_interval
    )
    out = Path(cfg.train.output_dir)
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision=plan.accelerate_mixed_precision,
        log_with=list(cfg.train.log_with) or None,
        project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "trackers")),
        kwargs_handlers=plan.accelerate_kwargs_handlers(),
    )
    return accelerator, plan


def _flat_scalars(d: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat_scalars(v, key + "."))
        elif isinstance(v, (int, float, str, bool)):
            out[key] = v
        else:
            out[key] = str(v)
    return out


def _keep_on_resume(row: dict, resumed_step: int, tc: Any) -> bool:
    """metrics.jsonl rows a resumed run keeps: those up to its step, except a final evaluation, which
    a resume from the last checkpoint runs (and logs) again."""
    final_eval = row.get("kind") == "eval" and row.get("step") == tc.max_steps
    return row.get("step", 0) <= resumed_step and not final_eval


def _clean(logs: dict) -> dict:
    return {k: finite_or_none(v) for k, v in logs.items()}


def train(cfg: Config, data: Any = None) -> dict:
    """Run ``bert-mp train`` for a loaded config; returns summary.json's content.

    ``data`` is a ``prepare.PreparedData``; None prepares (or reuses the cached) data from ``cfg``.
    """
    from accelerate.utils import set_seed

    from bert_mp.masking import PretrainingCollator

    tc = cfg.train
    accelerator, plan = _make_accelerator(cfg)
    plan.apply_backend_flags()
    world, rank = accelerator.num_processes, accelerator.process_index
    per_rank = tc.global_batch_size // world
    if tc.global_batch_size % (tc.micro_batch_size * world):
        raise ConfigError(
            f"train.global_batch_size={tc.global_batch_size} must be a multiple of train.micro_batch_size "
            f"({tc.micro_batch_size}) x processes ({world})"
        )
    accumulation = per_rank // tc.micro_batch_size

    if data is None:
        from bert_mp.prepare import load_prepared, prepare

        with accelerator.main_process_first():
            data = load_prepared(prepare(cfg))
    train_ds, val_ds, stats = data.dataset["train"], data.dataset["validation"], data.stats
    if len(train_ds) < tc.global_batch_size:
        raise DataError(
            f"the train split has {len(train_ds)} examples, fewer than train.global_batch_size="
            f"{tc.global_batch_size}; prepare more data or lower the batch size"
        )

    out = Path(tc.output_dir)
    ckpt_dir = out / "checkpoints"
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")

    # ---- build -----------------------------------------------------------------------------------
    set_seed(tc.seed)
    model = build_model(
        cfg.model,
        vocab_size=int(stats["model_vocab_size"]),
        tokenizer_size=int(stats.get("tokenizer_size", len(data.tokenizer))),
        max_seq_length=int(stats.get("max_seq_length", cfg.data.max_seq_length)),
        pad_token_id=int(data.tokenizer.pad_token_id or 0),
    )
    dropout_impl = resolve_dropout_impl(cfg.model.dropout_impl, accelerator.device)
    if dropout_impl == "fast":
        install_fast_dropout(model)
    counts = parameter_counts(model)
    wrapped = PretrainingModel(model, sparse_mlm_head=cfg.model.sparse_mlm_head)
    optimizer = build_optimizer(wrapped, tc, accelerator.device)
    scheduler = build_scheduler(optimizer, tc)
    scaler = install_scaler(accelerator, plan)
    wrapped, optimizer = accelerator.prepare(wrapped, optimizer)
    # The scheduler is stepped by hand (only after a real optimizer step, once per global batch),
    # so it is not prepared - only registered for checkpointing.
    accelerator.register_for_checkpointing(scheduler)
    set_seed(tc.seed + rank)  # dropout streams differ per rank

    state = LoopState()
    resumed_from = None
    if tc.resume:
        folder = ckpt.resolve_resume(tc.resume, ckpt_dir)
        if folder is None:
            warnings.warn(
                f"train.resume=latest: no complete checkpoint in {ckpt_dir}; starting fresh", stacklevel=2
            )
        else:
            state.load_state_dict(ckpt.load_checkpoint(accelerator, folder))
            resumed_from = str(folder)

    collator = PretrainingCollator(data.tokenizer, cfg.data, seed=tc.seed, pad_to_multiple_of=8)
    sampler = MicroBatchSampler(
        len(train_ds),
        tc.global_batch_size,
        tc.micro_batch_size,
        rank,
        world,
        tc.seed,
        state.epoch,
        state.batch_in_epoch,
    )
    loader = DataLoader(
        _Indexed(train_ds),
        batch_sampler=sampler,
        collate_fn=collator,
        num_workers=tc.num_workers,
        # A private generator: creating a loader iterator must not draw from the global RNG, or a
        # resumed run's dropout stream would differ from an uninterrupted one.
        generator=torch.Generator(),
    )
    batches = iter(loader)

    callbacks = build_callbacks(cfg)
    ctx = TrainContext(
        cfg=cfg,
        device=accelerator.device,
        precision=plan.describe(scaler),
        param_counts=counts,
        hidden_size=model.config.hidden_size,
        num_layers=model.config.num_hidden_layers,
        vocab_size=model.config.vocab_size,
        num_processes=world,
        is_main_process=accelerator.is_main_process,
        scaler=scaler,
    )
    writer = None
    if accelerator.is_main_process:
        metrics_path = out / "metrics.jsonl"
        # A checkpoint copied without its run's metrics.jsonl resumes with a log that starts here.
        kept = (
            [r for r in read_jsonl(metrics_path) if _keep_on_resume(r, state.step, tc)]
            if resumed_from and metrics_path.exists()
            else []
        )
        writer = JsonlWriter(metrics_path)
        for r in kept:
            writer.write(r)
    if tc.log_with:
        accelerator.init_trackers("bert_mp", config=_flat_scalars(config_to_dict(cfg)))
    for cb in callbacks:
        cb.on_train_start(state, ctx)

    summary: dict = {
        "status": "running",
        "resumed_from": resumed_from,
        "precision": ctx.precision,
        "versions": library_versions(),
        "model": {
            "preset": cfg.model.preset,
            "config": model.config.to_diff_dict(),
            "parameters": counts,
            "dropout_impl": dropout_impl,
            "attn_implementation": model.config._attn_implementation,
        },
        "batch": {
            "global": tc.global_batch_size,
            "micro": tc.micro_batch_size,
            "processes": world,
            "accumulation": accumulation,
        },
        "data": {
            "path": str(getattr(data, "path", "")),
            "train_examples": len(train_ds),
            "validation_examples": len(val_ds),
        },
    }

    def save() -> Path:
        state.elapsed_s = elapsed()
        return ckpt.save_checkpoint(
            accelerator, ckpt_dir, state.step, state.state_dict(), tc.save_total_limit
        )

    start = time.perf_counter()
    elapsed_before = state.elapsed_s

    def elapsed() -> float:
        return elapsed_before + time.perf_counter() - start

    def finish(status: str, final_eval: dict | None, error: str | None = None) -> dict:
        summary.update(status=status, steps=state.step, elapsed_s=elapsed(), final_eval=final_eval)
        summary["stop_reason"] = state.stop_reason
        summary["skipped_steps"] = state.skipped_steps
        summary["tokens_seen"] = state.tokens_seen
        if error:
            summary["error"] = error
        for cb in callbacks:
            cb.on_train_end(state, summary)
        if accelerator.is_main_process:
            atomic_write_json(out / "summary.json", _clean(summary))
        if writer:
            writer.close()
        if tc.log_with:
            accelerator.end_training()
        return summary

    def run_eval() -> dict:
        logs = {
            "step": state.step,
            "kind": "eval",
            **evaluate(wrapped, val_ds, collator, cfg, accelerator, plan),
        }
        for cb in callbacks:
            cb.on_eval_end(state, logs)
        if writer:
            writer.write(_clean(logs))
        if tc.log_with:
            accelerator.log({k: v for k, v in logs.items() if isinstance(v, float)}, step=state.step)
        return logs

    bar = None
    if accelerator.is_main_process and tc.progress_bar:
        from tqdm.auto import tqdm

        bar = tqdm(total=tc.max_steps, initial=state.step, desc=f"train {plan.name}", dynamic_ncols=True)

    # ---- loop ------------------------------------------------------------------------------------
    wrapped.train()
    t_prev = time.perf_counter()
    try:
        with stop_on_signals(state):
            while state.step < tc.max_steps:
                wait = time.perf_counter()
                micro = [next(batches) for _ in range(accumulation)]
                wait = time.perf_counter() - wait
                # Normalisers of the whole step: masked tokens and sequences over all micro-batches and ranks.
                local = torch.tensor(
                    [float(sum(int((b["labels"] != -100).sum()) for b in micro)), float(per_rank)],
                    device=accelerator.device,
                )
                n_masked, n_seqs = accelerator.reduce(local, reduction="sum").tolist()
                sums = torch.zeros(len(_SUM_KEYS), device=accelerator.device)
                for i, batch in enumerate(micro):
                    batch = {k: v.to(accelerator.device, non_blocking=True) for k, v in batch.items()}
                    sync = i == accumulation - 1
                    with contextlib.nullcontext() if sync else accelerator.no_sync(wrapped):
                        with plan.autocast():
                            o = wrapped(**batch)
                        # x world: DDP averages gradients over ranks, the normalisers are already global
                        loss = world * (o["mlm_loss_sum"] / max(n_masked, 1.0) + o["nsp_loss_sum"] / n_seqs)
                        accelerator.backward(loss)
                    sums += torch.stack([o[k].detach().float() for k in _SUM_KEYS])
                tokens = sum(int(b["attention_mask"].sum()) for b in micro)
                padded = sum(b["attention_mask"].numel() for b in micro)
                attn = sum(b["attention_mask"].shape[0] * b["attention_mask"].shape[1] ** 2 for b in micro)
                extra = torch.tensor(
                    [tokens, padded, attn, 1.0 if state.pending_signal else 0.0], device=accelerator.device
                )
                totals = accelerator.reduce(torch.cat([sums, extra.float()]), reduction="sum").tolist()
                s = dict(zip(_SUM_KEYS, totals[:6]))
                step_loss = s["mlm_loss_sum"] / max(s["mlm_count"], 1.0) + s["nsp_loss_sum"] / max(
                    s["nsp_count"], 1.0
                )
                if not math.isfinite(step_loss) and scaler is None:
                    optimizer.zero_grad(set_to_none=True)
                    path = save()
                    raise TrainingError(
                        f"non-finite loss ({step_loss}) at step {state.step + 1} in {plan.name}; state before "
                        f"the step saved to {path}. Lower train.learning_rate or raise train.warmup_steps."
                    )

                lr = scheduler.get_last_lr()[0]
                grad_norm, skipped = optimizer_step(
                    accelerator, optimizer, wrapped.parameters(), tc.max_grad_norm, scaler
                )

                state.batch_in_epoch += 1
                if state.batch_in_epoch >= sampler.batches_per_epoch:
                    state.epoch, state.batch_in_epoch = state.epoch + 1, 0
                if totals[-1] > 0:  # decided from the all-reduced flag, so every rank stops at this step
                    state.stop_reason = (
                        state.stop_reason or f"signal {state.pending_signal or 'on another rank'}"
                    )
                if skipped:
                    state.skipped_steps += 1
                    state.consecutive_skips += 1
                    collapsed = scaler.get_scale() < MIN_LOSS_SCALE
                    if state.consecutive_skips >= tc.max_consecutive_skipped_steps or collapsed:
                        path = save()
                        why = (
                            f"{state.consecutive_skips} optimizer steps in a row overflowed"
                            if not collapsed
                            else f"the loss scale collapsed below {MIN_LOSS_SCALE:g} after "
                            f"{state.skipped_steps} overflowed steps"
                        )
                        raise TrainingError(
                            f"fp16: {why} (loss scale {scaler.get_scale():g}); checkpoint saved to {path}. Try "
                            "train.precision=bf16, a lower learning rate, or a smaller train.fp16_init_scale."
                        )
                    if not state.stop_reason:
                        continue
                else:
                    scheduler.step()
                    state.step += 1
                    state.consecutive_skips = 0
                    state.tokens_seen += int(totals[6])
                    now = time.perf_counter()
                    state.facts = StepFacts(
                        **s,
                        tokens=int(totals[6]),
                        padded_tokens=int(totals[7]),
                        attention_flops_tokens=totals[8],
                        sequences=int(n_seqs),
                        lr=lr,
                        grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                        step_time_s=now - t_prev,
                        data_wait_s=wait,
                    )
                    t_prev = now
                    logs: dict = {"step": state.step, "kind": "train"}
                    for cb in callbacks:
                        cb.on_step_end(state, logs)
                    if writer:
                        writer.write(_clean(logs))
                    if state.step % tc.log_every == 0 or state.step == tc.max_steps:
                        if tc.log_with:
                            accelerator.log(
                                {k: v for k, v in logs.items() if isinstance(v, float)}, step=state.step
                            )
                        if bar is not None:
                            bar.set_postfix(
                                loss=f"{logs.get('loss/total', step_loss):.3f}",
                                mlm_acc=f"{logs.get('accuracy/mlm', 0.0):.3f}",
                                tok_s=f"{logs.get('throughput/tokens_per_sec', 0.0):.0f}",
                            )
                    if bar is not None:
                        bar.update(1)

                    if tc.eval_every and state.step % tc.eval_every == 0 and state.step < tc.max_steps:
                        run_eval()
                        t_prev = time.perf_counter()  # evaluation time is not step time
                    if tc.save_every and state.step % tc.save_every == 0 and state.step < tc.max_steps:
                        save()
                        t_prev = time.perf_counter()  # checkpoint time is not step time
                # a signal's flag went through the all-reduce and callbacks saw the same reduced logs,
                # so every rank agrees on stopping here
                if state.stop_reason:
                    break
    except TrainingError as e:
        if bar is not None:
            bar.close()
        finish("failed", None, error=str(e))
        raise
    if bar is not None:
        bar.close()

    # ---- evaluate and save -------------------------------------------------------------------------
    if state.stop_reason:
        save()
        return finish("stopped", None)
    final_eval = run_eval()
    save()
    if tc.export:
        ckpt.export_pretrained(accelerator, wrapped, data.tokenizer, out / "final")
        summary["export"] = str(out / "final")
    return finish("completed", _clean(final_eval))


def command(config_path: str | None, overrides: list[str]) -> int:
    """CLI entry: ``bert-mp train [CONFIG.yaml] [key=value ...]``."""
    cfg = load_config(config_path, overrides)
    summary = train(cfg)
    ev = summary["final_eval"]
    if ev:
        result = f"final eval MLM loss {ev['eval/loss_mlm']:.4f}, MLM accuracy {ev['eval/accuracy_mlm']:.3f}"
    else:
        result = f"{summary['stop_reason']}; checkpoint saved"
    print(
        f"bert-mp train: {summary['status']} after {summary['steps']} steps ({result}) -> {cfg.train.output_dir}"
    )
    return 0
