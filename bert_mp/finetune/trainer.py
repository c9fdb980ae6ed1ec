"""``bert-mp finetune``: sequence classification from an exported checkpoint, with plain transformers.

The checkpoint (a bert_mp ``final/`` folder, any BERT folder, or a Hub name) is loaded with
``BertForSequenceClassification.from_pretrained``: the pretraining heads (``cls.*``) are left unused
and only ``classifier.*`` is new, which the run records. Training follows the pretraining loop's
conventions - Accelerate, one precision plan from :mod:`bert_mp.core.precision`, fp32 loss, fp16 steps
skipped by the scaler advance neither the scheduler nor the step count - and writes ``config.yaml``,
``metrics.jsonl``, ``summary.json`` and ``final/`` (save_pretrained + tokenizer) into
``finetune.output_dir``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Sampler

from bert_mp.core.config import Config, FinetuneConfig, load_config, save_config
from bert_mp.core.io import JsonlWriter, atomic_write_json
from bert_mp.core.optim import fused_supported, param_groups
from bert_mp.core.precision import install_scaler, library_versions, optimizer_step, resolve_precision
from bert_mp.errors import ConfigError, TrainingError
from bert_mp.finetune.tasks import LabelSpace, TaskData, build_label_space, encode_labels, load_task

# Weights a classification model may legitimately lack in a pretraining checkpoint: the new head,
# and the pooler when the checkpoint came from a model without one (e.g. BertForMaskedLM).
_NEW_OK_PREFIXES = ("classifier.", "bert.pooler.")
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# A model's embedding table may be padded past its tokenizer (bert_mp rounds to 64, others to 128).
_MAX_VOCAB_PADDING = 128


# --------------------------------------------------------------------------------------------------
# metrics (pure)
# --------------------------------------------------------------------------------------------------
def classification_metrics(y_true: Sequence[int], y_pred: Sequence[int]) -> dict[str, Any]:
    """Accuracy, macro-F1 and Matthews correlation, plus per-class F1.

    Classes are those occurring in ``y_true`` or ``y_pred`` (scikit-learn's convention). The MCC is
    Gorodkin's multi-class form, which equals the usual binary MCC for two classes.
    """
    n = len(y_true)
    if n == 0:
        return {"accuracy": None, "macro_f1": None, "mcc": None, "per_class_f1": {}, "examples": 0}
    true_counts, pred_counts = Counter(y_true), Counter(y_pred)
    tp = Counter(t for t, p in zip(y_true, y_pred) if t == p)
    classes = sorted(set(true_counts) | set(pred_counts))
    f1 = {}
    for c in classes:
        denom = true_counts[c] + pred_counts[c]
        f1[c] = 2 * tp[c] / denom if denom else 0.0
    correct = sum(tp.values())
    cov_tp = correct * n - sum(true_counts[c] * pred_counts[c] for c in classes)
    cov_pp = n * n - sum(v * v for v in pred_counts.values())
    cov_tt = n * n - sum(v * v for v in true_counts.values())
    mcc = cov_tp / math.sqrt(cov_pp * cov_tt) if cov_pp > 0 and cov_tt > 0 else 0.0
    return {
        "accuracy": correct / n,
        "macro_f1": sum(f1.values()) / len(classes),
        "mcc": mcc,
        "per_class_f1": f1,
        "examples": n,
    }


# --------------------------------------------------------------------------------------------------
# checkpoint, tokenizer, model
# --------------------------------------------------------------------------------------------------
def resolve_checkpoint(ref: str | None) -> str:
    """A local BERT folder (a train run folder means its ``final/``) or a Hub name, checked early."""
    from transformers import AutoConfig

    if not ref:
        raise ConfigError(
            "finetune.checkpoint: set it to an exported folder (e.g. runs/train/final), a BERT checkpoint "
            "folder, or a Hub name such as google-bert/bert-base-uncased"
        )
    path = Path(ref).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() and (path / "final" / "config.json").is_file():
            path = path / "final"
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"finetune.checkpoint: {ref} is not a BERT checkpoint (no config.json); point it at a "
                "save_pretrained folder such as <train.output_dir>/final"
            )
        if not any((path / f).is_file() for f in _WEIGHT_FILES):
            raise ConfigError(
                f"finetune.checkpoint: {path} has a config.json but no weights ({', '.join(_WEIGHT_FILES[::2])})"
            )
        try:
            model_type = json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"finetune.checkpoint: {path}/config.json is not valid JSON ({e})") from None
        ref = str(path)
    elif path.exists() or ref.startswith((".", "/", "~")) or ref.count("/") > 1:
        raise ConfigError(f"finetune.checkpoint: {ref} is not a folder")
    else:
        try:
            model_type = AutoConfig.from_pretrained(ref).model_type
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"finetune.checkpoint: {ref!r} is neither a local folder nor loadable from the Hub "
                f"({str(e).splitlines()[0]}); offline runs need a local folder"
            ) from None
    if model_type != "bert":
        raise ConfigError(
            f"finetune.checkpoint: {ref} is a {model_type!r} checkpoint; bert-mp finetune loads BERT (model_type bert)"
        )
    return ref


def load_tokenizer(ref: str) -> Any:
    """The tokenizer saved with the checkpoint (or named by finetune.tokenizer)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(ref)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(
            f"no tokenizer could be loaded from {ref} ({str(e).splitlines()[0]}); set finetune.tokenizer to "
            "the tokenizer the checkpoint was trained with"
        ) from None
    if tok.pad_token_id is None or tok.cls_token_id is None or tok.sep_token_id is None:
        raise ConfigError(f"tokenizer {ref} lacks [PAD]/[CLS]/[SEP] tokens; it is not a BERT tokenizer")
    return tok


def check_vocab(tokenizer: Any, vocab_size: int, ckpt: str, tok_ref: str) -> None:
    """The tokenizer must index the checkpoint's embeddings: same vocabulary, up to table padding."""
    n = len(tokenizer)
    if n > vocab_size or vocab_size - n > _MAX_VOCAB_PADDING:
        raise ConfigError(
            f"tokenizer {tok_ref} has {n} tokens but checkpoint {ckpt} has {vocab_size} embeddings: they do not "
            "belong together; set finetune.tokenizer to the tokenizer the checkpoint was trained with"
        )


def build_classifier(ckpt: str, labels: LabelSpace, init: str, seed: int) -> tuple[Any, dict]:
    """``BertForSequenceClassification`` from the checkpoint (or its architecture, freshly initialised).

    Returns the model and the loading record: weights newly initialised and checkpoint weights unused.
    """
    from transformers import BertConfig, BertForSequenceClassification, set_seed

    head = {"num_labels": labels.size, "id2label": labels.id2label(), "label2id": labels.label2id()}
    set_seed(seed)
    if init == "random":
        model = BertForSequenceClassification(BertConfig.from_pretrained(ckpt, **head))
        names = sorted(model.state_dict())
        return model, {"init": "random", "newly_initialized": names, "unused": []}
    model, info = BertForSequenceClassification.from_pretrained(
        ckpt, **head, ignore_mismatched_sizes=True, output_loading_info=True
    )
    mismatched = [k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys", [])]
    new = sorted(set(info["missing_keys"]) | set(mismatched))
    bad = [k for k in new if not k.startswith(_NEW_OK_PREFIXES)]
    if bad:
        raise ConfigError(
            f"finetune.checkpoint: {ckpt} lacks {len(bad)} encoder weights (e.g. {bad[0]}); it is not a "
            "compatible BERT checkpoint"
        )
    return model, {"init": "pretrained", "newly_initialized": new, "unused": sorted(info["unexpected_keys"])}


# --------------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------------
def tokenize_split(ds: Any, tokenizer: Any, max_length: int, has_pair: bool) -> tuple[Any, int]:
    """Token ids for one split; texts longer than ``max_length`` are truncated and counted."""

    def encode(batch: dict) -> dict:
        texts = batch["text"]
        pairs = batch["text_pair"] if has_pair else None
        enc = tokenizer(texts, pairs, truncation=False, verbose=False)
        long = [i for i, ids in enumerate(enc["input_ids"]) if len(ids) > max_length]
        if long:
            cut = tokenizer(
                [texts[i] for i in long],
                [pairs[i] for i in long] if pairs else None,
                truncation=True,
                max_length=max_length,
            )
            for j, i in enumerate(long):
                for key in enc:
                    enc[key][i] = cut[key][j]
        enc["truncated"] = [i in set(long) for i in range(len(texts))]
        return dict(enc)

    keep = {"label_id"}
    out = ds.map(encode, batched=True, remove_columns=[c for c in ds.column_names if c not in keep])
    n_truncated = int(sum(out["truncated"]))
    return out.remove_columns("truncated"), n_truncated


class EpochSampler(Sampler[int]):
    """A fresh permutation per epoch derived from (seed, epoch) only: reruns see the same order."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return iter(np.random.default_rng([self.seed, self.epoch]).permutation(self.n).tolist())


# --------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------
def evaluate(model: Any, loader: Any, accelerator: Any, plan: Any, num_labels: int) -> dict[str, Any]:
    """Loss (over labels the model knows) and classification metrics on one split."""
    model.eval()
    preds, trues, loss_sum, loss_n = [], [], 0.0, 0
    with torch.no_grad():
        for batch in loader:
            labels = batch.pop("labels")
            with plan.autocast():
                logits = model(**batch).logits
            logits = logits.float()
            known = labels < num_labels
            if known.any():
                loss_sum += float(F.cross_entropy(logits[known], labels[known], reduction="sum"))
                loss_n += int(known.sum())
            p, t = accelerator.gather_for_metrics((logits.argmax(-1), labels))
            preds += p.tolist()
            trues += t.tolist()
    model.train()
    totals = accelerator.reduce(torch.tensor([loss_sum, loss_n], device=accelerator.device), "sum").tolist()
    out = classification_metrics(trues, preds)
    out["loss"] = totals[0] / totals[1] if totals[1] else None
    return out


def _log_view(prefix: str, m: dict[str, Any]) -> dict[str, Any]:
    return {f"{prefix}/{k}": m[k] for k in ("loss", "accuracy", "macro_f1", "mcc")}


def _named(m: dict[str, Any], names: dict[int, str]) -> dict[str, Any]:
    """Metrics for summary.json with per-class F1 keyed by label name."""
    out = dict(m)
    out["per_class_f1"] = {names.get(c, f"unseen:{c}"): v for c, v in m["per_class_f1"].items()}
    return out


def run_finetune(cfg: Config) -> dict[str, Any]:
    """Fine-tune per ``cfg.finetune`` and return summary.json's content."""
    from accelerate import Accelerator, PartialState
    from transformers import BertConfig, DataCollatorWithPadding, get_linear_schedule_with_warmup, set_seed

    ft: FinetuneConfig = cfg.finetune
    t_start = time.perf_counter()
    ckpt = resolve_checkpoint(ft.checkpoint)
    tok_ref = ft.tokenizer or ckpt
    tokenizer = load_tokenizer(tok_ref)
    # Architecture checks read config.json only, so a mismatch fails before any data work.
    mcfg = BertConfig.from_pretrained(ckpt)
    check_vocab(tokenizer, mcfg.vocab_size, ckpt, tok_ref)
    if ft.max_seq_length > mcfg.max_position_embeddings:
        raise ConfigError(
            f"finetune.max_seq_length: {ft.max_seq_length} exceeds the checkpoint's "
            f"{mcfg.max_position_embeddings} position embeddings; set it to at most that"
        )

    # A precision the hardware lacks fails here too, before any data work.
    # Without CUDA, say so explicitly: Accelerate then uses gloo for multi-process CPU launches.
    cpu = not torch.cuda.is_available()
    plan = resolve_precision(ft.precision, PartialState(cpu=cpu).device)

    # ---- data ------------------------------------------------------------------------------------
    task: TaskData = load_task(ft)
    splits = task.splits
    class_names = task.stats.get("label_names")
    labels = build_label_space(splits["train"]["label"], class_names)
    unseen: dict[str, dict[str, int]] = {}
    for split in list(splits):
        ids, unseen_here = encode_labels(splits[split]["label"], labels, split, ft.unseen_labels)
        if unseen_here:
            unseen[split] = unseen_here
        splits[split] = splits[split].add_column("label_id", ids)
    # Examples of unseen labels in train would mean a label space that does not cover train.
    assert "train" not in unseen

    # ---- model -----------------------------------------------------------------------------------
    model, loading = build_classifier(ckpt, labels, ft.init, ft.seed)
    tokenized, truncated = {}, {}
    for split, ds in splits.items():
        tokenized[split], truncated[split] = tokenize_split(ds, tokenizer, ft.max_seq_length, task.has_pair)
        tokenized[split] = tokenized[split].rename_column("label_id", "labels")

    # ---- accelerator -----------------------------------------------------------------------------
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision=plan.accelerate_mixed_precision,
        kwargs_handlers=plan.accelerate_kwargs_handlers(),
    )
    plan.apply_backend_flags()
    world = accelerator.num_processes
    if ft.batch_size % world:
        raise ConfigError(f"finetune.batch_size: {ft.batch_size} is not divisible by {world} processes")
    out = Path(ft.output_dir)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")

    collate = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    sampler = EpochSampler(len(tokenized["train"]), ft.seed)
    train_loader = DataLoader(
        tokenized["train"],
        batch_size=ft.batch_size // world,
        sampler=sampler,
        collate_fn=collate,
        drop_last=False,
    )
    eval_loaders = {
        s: DataLoader(tokenized[s], batch_size=ft.eval_batch_size, collate_fn=collate)
        for s in ("validation", "test")
        if s in tokenized and len(tokenized[s])
    }
    steps_per_epoch = math.ceil(len(tokenized["train"]) / ft.batch_size)
    total_steps = ft.max_steps or ft.epochs * steps_per_epoch
    fused = fused_supported(accelerator.device)
    optimizer = torch.optim.AdamW(
        param_groups(model, ft.weight_decay), lr=ft.learning_rate, fused=fused or None
    )
    scheduler = get_linear_schedule_with_warmup(optimizer, round(ft.warmup_ratio * total_steps), total_steps)
    scaler = install_scaler(accelerator, plan)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    eval_loaders = {s: accelerator.prepare(dl) for s, dl in eval_loaders.items()}
    set_seed(ft.seed + accelerator.process_index)  # dropout streams differ per rank

    # ---- loop ------------------------------------------------------------------------------------
    writer = JsonlWriter(out / "metrics.jsonl") if accelerator.is_main_process else None
    names = labels.id2label()
    best: dict[str, Any] = {"step": None, "metrics": None, "state": None}
    step, skipped, epoch, examples = 0, 0, 0, 0
    last_eval_step = -1
    bar = None
    if ft.progress_bar and accelerator.is_main_process:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_steps, desc="finetune", dynamic_ncols=True)

    def validate_now() -> None:
        nonlocal last_eval_step
        last_eval_step = step
        if "validation" not in eval_loaders:
            return
        m = evaluate(model, eval_loaders["validation"], accelerator, plan, labels.size)
        if writer:
            writer.write(
                {"step": step, "kind": "eval", "epoch": step / steps_per_epoch, **_log_view("validation", m)}
            )
        if best["metrics"] is None or m["macro_f1"] > best["metrics"]["macro_f1"]:
            best.update(step=step, metrics=m)
            if ft.select_best:
                state = accelerator.unwrap_model(model).state_dict()
                best["state"] = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    model.train()
    t_train = time.perf_counter()
    while step < total_steps:
        sampler.set_epoch(epoch)
        for batch in train_loader:
            t0 = time.perf_counter()
            targets = batch.pop("labels")
            with plan.autocast():
                logits = model(**batch).logits
            loss = F.cross_entropy(logits.float(), targets)  # fp32 loss in every precision
            if not torch.isfinite(loss) and scaler is None:
                raise TrainingError(
                    f"non-finite fine-tuning loss at step {step + 1} ({plan.name}); lower "
                    "finetune.learning_rate or raise finetune.warmup_ratio"
                )
            accelerator.backward(loss)
            lr = scheduler.get_last_lr()[0]
            grad_norm, step_skipped = optimizer_step(
                accelerator, optimizer, model.parameters(), ft.max_grad_norm, scaler
            )
            if step_skipped:
                skipped += 1
                continue
            scheduler.step()
            step += 1
            examples += len(targets) * world
            if writer:
                row = {
                    "step": step,
                    "kind": "train",
                    "epoch": step / steps_per_epoch,
                    "loss/ce": float(loss.detach()),
                    "optim/lr": lr,
                    "optim/grad_norm": float(grad_norm),
                    "time/step_ms": 1000 * (time.perf_counter() - t0),
                }
                if scaler is not None:
                    row.update({"amp/loss_scale": float(scaler.get_scale()), "amp/skipped_steps": skipped})
                writer.write(row)
            if bar:
                bar.update(1)
                bar.set_postfix(loss=f"{float(loss):.4f}", refresh=False)
            if ft.eval_every and step % ft.eval_every == 0:
                validate_now()
            if step >= total_steps:
                break
        epoch += 1
        if not ft.eval_every and last_eval_step != step:
            validate_now()
    if last_eval_step != step:
        validate_now()
    train_s = time.perf_counter() - t_train
    if bar:
        bar.close()

    # ---- select, test, save ----------------------------------------------------------------------
    inner = accelerator.unwrap_model(model)
    if ft.select_best and best["state"] is not None:
        inner.load_state_dict(best["state"])
    final_val = best["metrics"] if ft.select_best else None
    if final_val is None and "validation" in eval_loaders:
        final_val = evaluate(model, eval_loaders["validation"], accelerator, plan, labels.size)
    test = (
        evaluate(model, eval_loaders["test"], accelerator, plan, labels.size)
        if "test" in eval_loaders
        else None
    )
    if writer:
        if test is not None:
            writer.write({"step": step, "kind": "test", **_log_view("test", test)})
        writer.close()

    final_dir = None
    if ft.save_model:
        final_dir = out / "final"
        if accelerator.is_main_process:
            tmp = out / ".tmp-final"
            shutil.rmtree(tmp, ignore_errors=True)
            inner.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            shutil.rmtree(final_dir, ignore_errors=True)
            os.replace(tmp, final_dir)
        accelerator.wait_for_everyone()

    summary = {
        "status": "completed",
        "checkpoint": ckpt,
        "tokenizer": tok_ref,
        "loading": {
            "init": loading["init"],
            "newly_initialized": loading["newly_initialized"][:50],
            "newly_initialized_count": len(loading["newly_initialized"]),
            "unused": loading["unused"],
        },
        "task": {
            "name": task.name,
            "labels": labels.names,
            "num_labels": labels.size,
            "sizes": {s: len(ds) for s, ds in tokenized.items()},
            "truncated": truncated,
            "max_seq_length": ft.max_seq_length,
            "unseen_labels": unseen,
            "unseen_policy": ft.unseen_labels,
            **{k: v for k, v in task.stats.items() if k not in ("label_names", "classes")},
        },
        "steps": step,
        "epochs_started": epoch,
        "skipped_steps": skipped,
        "train_elapsed_s": train_s,
        "elapsed_s": time.perf_counter() - t_start,
        "throughput": {"examples_per_sec": examples / train_s if train_s > 0 else None},
        "selected": {
            "step": best["step"] if ft.select_best else step,
            "rule": "best validation macro_f1" if ft.select_best else "last step",
        },
        "validation": _named(final_val, names) if final_val else None,
        "test": _named(test, names) if test else None,
        "precision": plan.describe(scaler),
        "versions": library_versions(),
        "model": {
            "hidden_size": inner.config.hidden_size,
            "num_hidden_layers": inner.config.num_hidden_layers,
            "parameters": sum(p.numel() for p in inner.parameters()),
        },
        "final": str(final_dir) if final_dir else None,
    }
    if accelerator.is_main_process:
        atomic_write_json(out / "summary.json", summary)
    return summary


def _fmt(v: Any) -> str:
    return "n/a" if v is None else f"{v:.4f}"


def command(config_path: str | None, overrides: list[str]) -> int:
    """CLI entry: ``bert-mp finetune [CONFIG.yaml] [key=value ...]``."""
    cfg = load_config(config_path, overrides)
    s = run_finetune(cfg)
    print(
        f"bert-mp finetune: {s['task']['name']} ({s['task']['num_labels']} labels), {s['steps']} steps, "
        f"{s['precision']['name']}, init={s['loading']['init']}"
    )
    for split in ("validation", "test"):
        m = s[split]
        if m:
            print(
                f"  {split:<10} accuracy {_fmt(m['accuracy'])}  macro-F1 {_fmt(m['macro_f1'])}  MCC {_fmt(m['mcc'])}"
                f"  ({m['examples']} examples)"
            )
    print(f"  -> {cfg.finetune.output_dir}")
    return 0
