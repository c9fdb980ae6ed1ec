"""``bert-mp finetune``: the fine-tuning loop, sequence classification with plain transformers.

The classifier comes from :mod:`bert_mp.finetune.model`, the tokenised splits from
:mod:`bert_mp.finetune.tasks`, evaluation and best-model selection from :mod:`bert_mp.finetune.metrics`;
this module holds fine-tuning's parts of the loop whose skeleton, set-up sequence, guard, checkpoints
and resume (``finetune.resume=latest``) pretraining shares (:mod:`bert_mp.core.loop`); the loss is
fp32 in every precision. It writes ``config.yaml``,
``metrics.jsonl``, ``summary.json``, ``checkpoints/`` (on a stop, or every ``finetune.save_every``
steps) and ``final/`` (save_pretrained + tokenizer) into ``finetune.output_dir``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Sampler

from bert_mp.core.checkpoint.hf_folder import finish_hf_folder
from bert_mp.core.config import Config
from bert_mp.core.engine import gradients
from bert_mp.core.loop.callbacks import LoopStepFacts, LossScaleMonitor, TrainContext
from bert_mp.core.loop.epochs import epoch_order
from bert_mp.core.loop.skeleton import TrainingLoop
from bert_mp.core.loop.state import BatchGeometry, exit_code, outcome_line
from bert_mp.core.numerics.optimizers import Schedule, build_scheduler
from bert_mp.core.process import console
from bert_mp.core.storage.disk import write_folder_atomically
from bert_mp.errors import ConfigError, DataError
from bert_mp.finetune.metrics import (
    BestValidation,
    evaluate,
    fmt,
    log_view,
    metrics_line,
    named_metrics,
    selection_key,
    task_loss,
)
from bert_mp.finetune.model import (
    ClassifierBuilder,
    build_classifier,
    check_vocab,
    load_tokenizer,
    resolve_checkpoint,
    resolve_tokenizer,
)
from bert_mp.finetune.tasks import (
    LabelSpace,
    TaskData,
    TaskRecord,
    build_label_space,
    encode_labels,
    load_task,
    tokenize_split,
)

if TYPE_CHECKING:
    from bert_mp.core.config import FinetuneConfig


class EpochSampler(Sampler[int]):
    """A fresh permutation per epoch (:func:`bert_mp.core.loop.epochs.epoch_order`): reruns see the same order."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return iter(epoch_order(self.n, self.seed, self.epoch).tolist())


def batch_geometry(batch_size: int, processes: int) -> BatchGeometry:
    """One step's batch split evenly over the processes (fine-tuning takes no micro-batches)."""
    if batch_size % processes:
        raise ConfigError(
            f"finetune.batch_size={batch_size} must be divisible by the number of processes ({processes}): "
            f"each takes an equal share of every step; set finetune.batch_size="
            f"{-(-batch_size // processes) * processes}"
        )
    return BatchGeometry(batch_size, batch_size // processes, processes)


class FineTuner(TrainingLoop):
    """One fine-tuning run over the shared loop skeleton (:class:`bert_mp.core.loop.skeleton.TrainingLoop`).
    ``build_classifier`` is the seam for tests that inject faults into the model."""

    command = "finetune"
    warmup_key = "warmup_ratio"
    ft: FinetuneConfig
    build_classifier: ClassifierBuilder
    t_start: float
    """When the run was created: ``elapsed_s`` covers data and model loading too."""
    ckpt: str
    """The checkpoint the classifier starts from (a local folder or a Hub name)."""
    tok_ref: str
    tokenizer: Any
    loading: dict[str, Any]
    """The classifier's loading record (init, newly initialised and unused weights)."""
    task: TaskData
    labels: LabelSpace
    unseen: dict[str, dict[str, int]]
    """Per split: labels outside the train label space, with their counts."""
    tokenized: dict[str, Any]
    truncated: dict[str, int]
    sampler: EpochSampler
    train_loader: DataLoader
    eval_loaders: dict[str, DataLoader]
    steps_per_epoch: int
    best: BestValidation
    batches: Iterator[dict] | None
    """The current epoch's batches; None between epochs (and before the first)."""

    def __init__(self, cfg: Config, build_classifier: ClassifierBuilder = build_classifier):
        super().__init__(cfg, cfg.finetune)
        self.ft = cfg.finetune
        self.build_classifier = build_classifier
        self.t_start = time.perf_counter()

    # ---- set-up: the pieces of the shared sequence (bert_mp.core.loop.setup) ----------------------
    def check_run_folder(self) -> None:
        """The shared run-folder check, then where the weights and the tokenizer come from: before the
        run folder (and a missing ``runs/`` above it) is made for its lock, which would turn a Hub
        name such as ``runs/name`` into a local path."""
        super().check_run_folder()
        ft = self.ft
        self.ckpt = resolve_checkpoint(ft.checkpoint)
        self.tok_ref = resolve_tokenizer(ft.tokenizer) if ft.tokenizer else self.ckpt

    def check_inputs(self) -> None:
        """The tokenizer against the checkpoint's config.json (vocabulary, positions): before any data work."""
        from transformers import BertConfig

        ft = self.ft
        self.tokenizer = load_tokenizer(self.tok_ref)
        # The length the model is trained and selected at travels with the exported tokenizer, so
        # predict and pipeline(..., truncation=True) cut where fine-tuning cut.
        self.tokenizer.model_max_length = ft.max_seq_length
        mcfg = BertConfig.from_pretrained(self.ckpt)
        check_vocab(self.tokenizer, mcfg.vocab_size, self.ckpt, self.tok_ref)
        if ft.max_seq_length > mcfg.max_position_embeddings:
            raise ConfigError(
                f"finetune.max_seq_length: {ft.max_seq_length} exceeds the checkpoint's "
                f"{mcfg.max_position_embeddings} position embeddings; set it to at most that"
            )

    def batch_geometry(self, processes: int) -> BatchGeometry:
        return batch_geometry(self.ft.batch_size, processes)

    def load_data(self) -> None:
        """The task's splits with label ids, tokenised; the run's length in steps; best-model selection."""
        self.load_task()
        self.tokenize()
        self.steps_per_epoch = math.ceil(len(self.tokenized["train"]) / self.ft.batch_size)
        self.total_steps = self.ft.max_steps or self.ft.epochs * self.steps_per_epoch
        self.best = BestValidation(self.ft.select_best, selection_key(self.labels.regression))

    def build_model(self) -> Any:
        model, self.loading = self.build_classifier(self.ckpt, self.labels, self.ft.init, self.ft.seed)
        return model

    def build_scheduler(self, optimizer: Any) -> Any:
        warmup = round(self.ft.warmup_ratio * self.total_steps)
        return build_scheduler(optimizer, Schedule(warmup, self.total_steps, warmup_from_zero=True))

    def load_task(self) -> None:
        """The task's splits with label ids (a regression task's: its scores); labels unseen in train
        are counted (or refused)."""
        ft = self.ft
        self.task = load_task(ft)
        splits = self.task.splits
        self.unseen = {}
        if self.task.regression:
            self.labels = LabelSpace.for_regression()
            for split in list(splits):
                splits[split] = splits[split].add_column(
                    "label_id", [float(v) for v in splits[split]["label"]]
                )
            return
        self.labels = build_label_space(splits["train"]["label"], self.task.stats.get("label_names"))
        for split in list(splits):
            ids, unseen_here = encode_labels(splits[split]["label"], self.labels, split, ft.unseen_labels)
            if unseen_here:
                self.unseen[split] = unseen_here
            splits[split] = splits[split].add_column("label_id", ids)
        if "train" in self.unseen:
            raise DataError(
                f"finetune: train has labels outside its own label space ({self.unseen['train']})"
            )

    def tokenize(self) -> None:
        self.tokenized, self.truncated = {}, {}
        for split, ds in self.task.splits.items():
            enc, self.truncated[split] = tokenize_split(
                ds, self.tokenizer, self.ft.max_seq_length, self.task.has_pair
            )
            self.tokenized[split] = enc.rename_column("label_id", "labels")

    def prepare(self, model: Any, optimizer: Any) -> tuple[Any, Any]:
        """The model, optimizer and loaders prepared by Accelerate."""
        from transformers import DataCollatorWithPadding

        ft, acc = self.ft, self.accelerator
        collate = DataCollatorWithPadding(self.tokenizer, pad_to_multiple_of=8)
        self.sampler = EpochSampler(len(self.tokenized["train"]), ft.seed)
        # Private generators: starting a loader must not draw from the global RNG, or a resumed run's
        # dropout stream would differ from an uninterrupted one.
        train_loader = DataLoader(
            self.tokenized["train"],
            batch_size=self.geometry.micro_batch,
            sampler=self.sampler,
            collate_fn=collate,
            drop_last=False,
            generator=torch.Generator(),
        )
        model, optimizer, self.train_loader = acc.prepare(model, optimizer, train_loader)
        self.eval_loaders = {
            s: acc.prepare(
                DataLoader(
                    self.tokenized[s],
                    batch_size=ft.eval_batch_size,
                    collate_fn=collate,
                    generator=torch.Generator(),
                )
            )
            for s in self.tokenized
            if s != "train" and len(self.tokenized[s])
        }
        self.batches = None
        return model, optimizer

    def checkpointed(self) -> tuple[Any, ...]:
        return (self.best,)

    def build_callbacks(self) -> list[Any]:
        return [LossScaleMonitor(self.cfg)]  # the shared monitors that apply here

    def on_start(self) -> None:
        """The shared monitors learn the run's device, precision and scaler (step rows only)."""
        self.start_callbacks(TrainContext)

    # ---- one step ----------------------------------------------------------------------------------
    def next_batch(self) -> tuple[dict, bool]:
        """The next training batch from the checkpointed data position; True when it ends an epoch."""
        if self.batches is None:
            self.sampler.set_epoch(self.state.epoch)
            loader = self.train_loader
            if self.state.batch_in_epoch:
                loader = self.accelerator.skip_first_batches(loader, self.state.batch_in_epoch)
            self.batches = iter(loader)
        batch = next(self.batches)
        ended = self.state.advance_batch(len(self.train_loader))
        if ended:
            self.batches = None
        return batch, ended

    def train_step(self) -> None:
        """Forward/backward with an fp32 loss, guard, optimizer step; then record and evaluate."""
        s, acc = self.state, self.accelerator
        t0 = time.perf_counter()
        batch, epoch_ended = self.next_batch()
        targets = batch.pop("labels")
        with self.plan.autocast():
            logits = self.model(**batch).logits
        loss = task_loss(logits, targets, self.labels.regression)  # fp32 loss in every precision
        # one reduction per step: the loss every rank judges the same way, and the stop flag
        flag = self.stop_flag()  # a signal caught here, or the launcher gone
        total_loss, stop = acc.reduce(
            torch.stack([loss.detach(), torch.tensor(flag, device=loss.device)]), "sum"
        ).tolist()
        self.guard.check_loss(total_loss, s, self.save_discarding_gradients)
        gradients.backward(acc, loss)
        lr, grad_norm, skipped = self.update(stop, (batch, targets))
        if not skipped:
            s.examples_seen += len(targets) * acc.num_processes
            self.record_step(float(loss.detach()), lr, grad_norm, t0)
            if self.ft.eval_every and s.step % self.ft.eval_every == 0:
                self.validate()
        if epoch_ended and not self.ft.eval_every and self.best.last_eval_step != s.step:
            self.validate()
        if self.checkpointer.due(s.step) and not skipped:
            self.save()

    def record_step(self, loss: float, lr: float, grad_norm: Any, t0: float) -> None:
        """One step's row: the loss, LR, gradient norm and time, then what the shared monitors add
        (``amp/loss_scale``, ``amp/skipped_steps`` under fp16)."""
        facts = LoopStepFacts(lr=lr, grad_norm=float(grad_norm), step_time_s=time.perf_counter() - t0)
        row = {
            "step": self.state.step,
            "kind": "train",
            "epoch": self.state.step / self.steps_per_epoch,
            "loss/ce": loss,
            "optim/lr": facts.lr,
            "optim/grad_norm": facts.grad_norm,
            "time/step_ms": 1000 * facts.step_time_s,
        }
        for cb in self.callbacks:
            cb.on_step_end(self.state, facts, row)
        self.log.write(row)
        self.log.progress(1, loss=f"{loss:.4f}")

    def validate(self) -> None:
        step = self.state.step
        self.best.last_eval_step = step
        if "validation" not in self.eval_loaders:
            return
        m = self.evaluate_split("validation")
        self.log.write(
            {"step": step, "kind": "eval", "epoch": step / self.steps_per_epoch, **log_view("validation", m)}
        )
        self.log.say(f"bert-mp finetune: step {step} validation: loss {fmt(m['loss'])}, {metrics_line(m)}")
        self.best.offer(step, m, self.accelerator.unwrap_model(self.model))

    def hessian_loss(self, batch: tuple[dict, torch.Tensor]) -> Callable[[], torch.Tensor]:
        """The step's loss for Sophia's Hutchinson estimate (see :mod:`bert_mp.core.numerics.hessian`)."""
        inputs, targets = batch

        def loss() -> torch.Tensor:
            with self.plan.autocast():
                return task_loss(self.model(**inputs).logits, targets, self.labels.regression)

        return loss

    # ---- select, test, export, finish --------------------------------------------------------------
    def complete(self) -> dict[str, Any]:
        """A finished run validates, selects, tests (and evaluates the task's other labelled splits,
        such as MNLI's mismatched validation) and exports."""
        if self.best.last_eval_step != self.state.step:
            self.validate()
        inner = self.accelerator.unwrap_model(self.model)
        if self.ft.select_best and self.best.weights is not None:
            inner.load_state_dict(self.best.weights)
        final_val = self.best.metrics if self.ft.select_best else None
        if final_val is None and "validation" in self.eval_loaders:
            final_val = self.evaluate_split("validation")
        test = self.evaluate_split("test") if "test" in self.eval_loaders else None
        if test is not None:
            self.log.write({"step": self.state.step, "kind": "test", **log_view("test", test)})
        others = {s: self.evaluate_split(s) for s in self.eval_loaders if s not in ("validation", "test")}
        for split, m in others.items():
            self.log.write({"step": self.state.step, "kind": "eval", **log_view(split, m)})
        final_dir = self.export(inner, final_val, test) if self.ft.save_model else None
        return self.finish("completed", final_val=final_val, test=test, final_dir=final_dir, others=others)

    def evaluate_split(self, split: str) -> dict[str, Any]:
        return evaluate(self.model, self.eval_loaders[split], self.accelerator, self.plan, self.labels)

    def export(self, inner: Any, final_val: dict | None, test: dict | None) -> Path:
        """final/: save_pretrained + tokenizer + model card, renamed into place when complete."""
        out = Path(self.ft.output_dir)
        final_dir = out / "final"
        if self.accelerator.is_main_process:

            def write(tmp: Path) -> None:
                dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[self.ft.export_dtype]
                inner.to(dtype).save_pretrained(tmp, safe_serialization=True)  # bf16_pure: fp32 by default
                self.tokenizer.save_pretrained(tmp)
                self.task_record().write(tmp)
                facts = self.card_facts(final_val, test)
                finish_hf_folder(tmp, "classification", inner.config.max_position_embeddings, facts)

            write_folder_atomically(
                final_dir,
                write,
                "the export",
                sum(p.numel() * p.element_size() for p in inner.parameters()),
                lambda: (
                    "free disk space and run it again (finetune.resume=latest continues from its newest checkpoint)"
                ),
            )
        self.accelerator.wait_for_everyone()
        return final_dir

    def task_record(self) -> TaskRecord:
        """What predict needs to read a file as this run read its splits (final/bert_mp_task.json)."""
        cols, labels = self.task.columns, self.labels
        return TaskRecord(
            task=self.task.name,
            text_column=cols["text"],
            text_pair_column=cols["text_pair"],
            label_column=cols["label"],
            max_seq_length=self.ft.max_seq_length,
            label_values=list(labels.values),
            label_names=list(labels.names),
            class_ids="label_names" in self.task.stats,
        )

    def card_facts(self, final_val: dict | None, test: dict | None) -> dict[str, Any]:
        """The model card's table for the fine-tuned export."""
        ft, labels, key = self.ft, self.labels, self.best.key.replace("macro_f1", "macro-F1")
        return {
            "base checkpoint": self.ckpt,
            "task": f"{self.task.name}: "
            + ("a regression (one score)" if labels.regression else f"{labels.size} labels")
            + f" ({', '.join(map(str, labels.names[:8]))})",
            "steps": f"{self.state.step} optimizer steps of {ft.batch_size} examples, max {ft.max_seq_length} tokens",
            "precision": self.plan.name,
            f"validation {key}": fmt((final_val or {}).get(self.best.key)),
            f"test {key}": fmt((test or {}).get(self.best.key)),
        }

    def summary_extras(
        self,
        final_val: dict | None = None,
        test: dict | None = None,
        final_dir: Path | None = None,
        others: dict[str, dict] | None = None,
    ) -> dict[str, Any]:
        """Checkpoint, tokenizer, loading, task, times and throughput, selection, metrics (``other_splits``:
        the task's further labelled splits), model, final/."""
        s, ft = self.state, self.ft
        names = {
            split: self.labels.metric_names(self.unseen.get(split, {}))
            for split in ("validation", "test", *(others or {}))
        }
        inner = self.accelerator.unwrap_model(self.model)
        train_s = self.checkpointer.elapsed()
        return {
            "checkpoint": self.ckpt,
            "tokenizer": self.tok_ref,
            "loading": {
                "init": self.loading["init"],
                "newly_initialized": self.loading["newly_initialized"][:50],
                "newly_initialized_count": len(self.loading["newly_initialized"]),
                "unused": self.loading["unused"],
            },
            "task": self.task_summary(),
            "epochs_started": s.epoch + (1 if s.batch_in_epoch else 0),
            "train_elapsed_s": train_s,
            "elapsed_s": time.perf_counter() - self.t_start,
            "throughput": {"examples_per_sec": s.examples_seen / train_s if train_s > 0 else None},
            "selected": {
                "step": self.best.step if ft.select_best else s.step,
                "rule": f"best validation {self.best.key}" if ft.select_best else "last step",
            },
            "validation": named_metrics(final_val, names["validation"]) if final_val else None,
            "test": named_metrics(test, names["test"]) if test else None,
            "other_splits": {s: named_metrics(m, names[s]) for s, m in (others or {}).items()},
            "model": {
                "hidden_size": inner.config.hidden_size,
                "num_hidden_layers": inner.config.num_hidden_layers,
                "parameters": sum(p.numel() for p in inner.parameters()),
            },
            "final": str(final_dir) if final_dir else None,
        }

    def task_summary(self) -> dict[str, Any]:
        task, ft = self.task, self.ft
        return {
            "name": task.name,
            "labels": self.labels.names,
            "num_labels": self.labels.size,
            "regression": self.labels.regression,
            "sizes": {s: len(ds) for s, ds in self.tokenized.items()},
            "truncated": self.truncated,
            "max_seq_length": ft.max_seq_length,
            "unseen_labels": self.unseen,
            "unseen_policy": ft.unseen_labels,
            **{k: v for k, v in task.stats.items() if k not in ("label_names", "classes")},
        }


def run_finetune(cfg: Config, *, build_classifier: ClassifierBuilder = build_classifier) -> dict[str, Any]:
    """Fine-tune per ``cfg.finetune`` and return summary.json's content."""
    return FineTuner(cfg, build_classifier).run()


def command(cfg: Config) -> int:
    """CLI entry: ``bert-mp finetune [CONFIG.yaml] [key=value ...]`` for the config the CLI loaded."""
    s = run_finetune(cfg)
    if s["status"] != "completed":  # no final/: `bert-mp finetune ... && bert-mp predict ...` stops here
        console.show(outcome_line("finetune", s, cfg.finetune.output_dir))
        return exit_code(s)
    console.show(
        f"bert-mp finetune: {s['task']['name']} "
        f"({'a regression' if s['task']['regression'] else str(s['task']['num_labels']) + ' labels'}), {s['steps']} steps, "
        f"{s['precision']['name']}, init={s['loading']['init']}"
    )
    for split, m in (("validation", s["validation"]), ("test", s["test"]), *s["other_splits"].items()):
        if m:
            console.show(f"  {split:<10} {metrics_line(m)}  ({m['examples']} examples)")
    console.show(f"  -> {cfg.finetune.output_dir}")
    return 0
