"""``bert-mp export RUN_OR_CHECKPOINT``: a pretraining checkpoint (even of a stopped run) -> a Hugging
Face folder, and the model card's facts of a pretraining export (``--push_to_hub``: then the Hub,
:mod:`bert_mp.pretrain.hub_push`).

The folder is finished like every other export (:func:`bert_mp.core.checkpoint.hf_folder.finish_hf_folder`: the
tokenizer's length limit, a model card, weight checksums) and written atomically.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bert_mp.core.checkpoint import store as ckpt
from bert_mp.core.checkpoint.hf_folder import finish_hf_folder
from bert_mp.core.storage import disk as storage
from bert_mp.errors import ConfigError


def pretraining_facts(cfg: Any, steps: int, precision: str, final_eval: dict | None, data: dict) -> dict:
    """The model card's table for a pretraining export."""
    ev = final_eval or {}
    d = cfg.data
    source = d.source if d.source != "hub" else f"hub: {d.hub_name} {d.hub_config or ''}".strip()
    return {
        "architecture": f"BertForPreTraining, preset {cfg.model.preset}",
        "data": f"{source}; {data.get('train_examples', '?')} training examples of up to {d.max_seq_length} tokens",
        "objective": "MLM + NSP (masked LM 15%, 80/10/10; next-sentence prediction)",
        "steps": f"{steps} optimizer steps of {cfg.train.global_batch_size} sequences",
        "precision": precision,
        "eval MLM loss": f"{ev['eval/loss_mlm']:.4f}" if "eval/loss_mlm" in ev else None,
        "eval MLM accuracy": f"{ev['eval/accuracy_mlm']:.3f}" if "eval/accuracy_mlm" in ev else None,
        "eval NSP accuracy": f"{ev['eval/accuracy_nsp']:.3f}"
        if ev.get("eval/accuracy_nsp") is not None
        else None,
        "data fingerprint": data.get("fingerprint"),
    }


def locate_checkpoint(ref: str | Path) -> tuple[Path, Path]:
    """``(checkpoint folder, run folder)`` for a run folder (its newest complete checkpoint) or a checkpoint."""
    path = Path(ref).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{ref}: no such folder (give a train run folder or one of its checkpoints)")
    if (path / ckpt.MARKER).is_file() or path.name.startswith("step_"):
        problem = ckpt.verify(path)
        if problem:
            raise ConfigError(f"{ref}: cannot export this checkpoint: {problem}")
        return path, path.parent.parent
    if (path / "checkpoints").is_dir():
        latest = ckpt.find_latest(path / "checkpoints")
        if latest is not None:
            return latest, path
    if (path / "config.json").is_file():
        raise ConfigError(f"{ref}: is already a Hugging Face folder (it has config.json); load it directly")
    raise ConfigError(
        f"{ref}: no complete checkpoint in {path / 'checkpoints'} (is it a bert-mp train run folder?)"
    )


@dataclass
class ExportSource:
    """What an export is built from, each file read once: the verified checkpoint, its run's
    ``config.yaml``, the checkpoint's ``loop_state.json`` and the run's ``summary.json`` (``{}``
    for a run that never wrote one, such as a killed one)."""

    folder: Path
    run: Path
    cfg: Any
    loop_state: dict
    summary: dict

    @property
    def step(self) -> int:
        return self.loop_state["step"]

    @property
    def data_facts(self) -> dict:
        """The data the run trained on: the checkpoint's fingerprint, then the summary's data section."""
        fingerprint = (self.loop_state.get("meta") or {}).get("data_fingerprint")
        return {"fingerprint": fingerprint, **self.summary.get("data", {})}


def read_source(ref: str | Path) -> ExportSource:
    """Locate and verify the checkpoint of ``ref``, then read its run's files (each once)."""
    import warnings

    from bert_mp.core.config import load_config
    from bert_mp.errors import BertMPWarning, TrainingError

    folder, run = locate_checkpoint(ref)
    if not (run / "config.yaml").is_file():
        raise ConfigError(
            f"{run}: no config.yaml (the checkpoint's run folder is needed to rebuild the model)"
        )
    if not ckpt.is_hashed(folder):
        warnings.warn(ckpt.size_only_note(folder), BertMPWarning, stacklevel=3)
    try:
        loop_state = ckpt.read_loop_state(folder)
    except TrainingError as e:
        raise ConfigError(str(e)) from None
    cfg = load_config(run / "config.yaml")
    summary_path = run / "summary.json"
    summary = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.is_file() else {}
    return ExportSource(folder, run, cfg, loop_state, summary)


def _rebuild(src: ExportSource) -> tuple[Any, Any]:
    """``(BertForPreTraining with the checkpoint's weights, the run's tokenizer)``."""
    from transformers import AutoTokenizer, BertConfig, BertForPreTraining

    from bert_mp.data.prepare import cache_path
    from bert_mp.model.bert import bert_config

    data = Path(src.summary.get("data", {}).get("path") or cache_path(src.cfg.data))
    if not (data / "tokenizer").is_dir():
        raise ConfigError(
            f"{data}: the run's prepared data (its tokenizer) is gone; "
            f"run `bert-mp prepare {src.run / 'config.yaml'}` first"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(data / "tokenizer"))
    model_conf = src.summary.get("model", {}).get("config")
    if model_conf:
        bcfg = BertConfig(**model_conf)
    else:
        stats = json.loads((data / "stats.json").read_text(encoding="utf-8"))
        model = src.cfg.model
        bcfg = bert_config(model, int(model.vocab_size or stats["model_vocab_size"]), tokenizer.pad_token_id)
    return _checkpoint_model(src.folder, BertForPreTraining(bcfg)), tokenizer


def _card_facts(src: ExportSource) -> dict:
    """The model card's table: the run's facts, the evaluation at (or before) the step, the checkpoint."""
    evaluation, eval_step = evaluation_at(src.run, src.step)
    facts = pretraining_facts(src.cfg, src.step, src.cfg.train.precision, evaluation, src.data_facts)
    if evaluation and eval_step != src.step:
        facts["evaluated"] = f"at step {eval_step} (the last evaluation before this checkpoint)"
    facts["checkpoint"] = f"{src.folder.name} of {src.run.name} (exported with bert-mp export)"
    return facts


def export_checkpoint(ref: str | Path, out: str | Path | None = None) -> Path:
    """Rebuild ``BertForPreTraining`` from a checkpoint and write a Hugging Face folder (default ``<run>/export-step_N``).

    The checkpoint is verified (sizes and digests) before any of it is read; the folder is written
    atomically, and a full disk ends in one line (:class:`bert_mp.errors.StorageError`).
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a "Writing model shards" bar is noise in a one-shot command
    src = read_source(ref)
    model, tokenizer = _rebuild(src)
    dest = Path(out) if out else src.run / f"export-{src.folder.name}"
    facts = _card_facts(src)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        finish_hf_folder(tmp, "pretraining", model.config.max_position_embeddings, facts)

    needed = sum(p.numel() * p.element_size() for p in model.parameters())
    storage.write_folder_atomically(
        dest,
        write,
        "the export",
        needed,
        lambda: f"{src.folder} is untouched. Free disk space and run bert-mp export again",
    )
    return dest


def evaluation_at(run: Path, step: int) -> tuple[dict | None, int | None]:
    """The run's evaluation at ``step`` (else its last one before it) from metrics.jsonl, and its step."""
    from bert_mp.core.storage.files import read_jsonl

    path = Path(run) / "metrics.jsonl"
    rows = read_jsonl(path) if path.is_file() else []
    evals = [r for r in rows if r.get("kind") == "eval" and int(r.get("step", 0)) <= step]
    if not evals:
        return None, None
    last = max(evals, key=lambda r: int(r["step"]))  # the last row of that step: a resume re-evaluates
    same = [r for r in evals if r["step"] == last["step"]]
    return same[-1], int(last["step"])


def _checkpoint_model(folder: Path, model: Any) -> Any:
    """``model`` with the weights of a verified checkpoint's ``model.safetensors`` (keys HF-native), or
    of its FSDP shards (``sharded/``, gathered in this process)."""
    from bert_mp.core.checkpoint.state_codec import StateFileError, read_safetensors
    from bert_mp.core.engine.sharding import SHARDED_DIR, read_model

    if (folder / SHARDED_DIR).is_dir():
        try:
            read_model(folder, model, prefix="model.")  # the run's model was PretrainingModel(model)
        except (KeyError, ValueError, RuntimeError, AssertionError) as e:
            raise ConfigError(f"{folder}: the shards do not fit the run's model ({str(e)[:200]})") from None
        model.tie_weights()
        return model
    try:
        tensors, _ = read_safetensors(folder / "model.safetensors")
    except StateFileError as e:
        raise ConfigError(f"{folder}: {e}") from None
    state = {k.removeprefix("model."): v for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    if unexpected or set(missing) - tied:
        raise ConfigError(
            f"{folder}: the weights do not fit the run's model (missing {sorted(set(missing) - tied)[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    model.tie_weights()
    return model


def command(
    ref: str,
    out: str | None = None,
    push_to_hub: str | None = None,
    revision: str | None = None,
    private: bool = False,
) -> int:
    if push_to_hub is None:
        if revision is not None or private:
            raise ConfigError("--revision and --private go with --push_to_hub REPO")
        dest = export_checkpoint(ref, out)
        print(f"bert-mp export: {dest} (loads with BertForPreTraining.from_pretrained)")
        return 0
    from bert_mp.pretrain.hub_push import check_repo_id, push_folder

    check_repo_id(push_to_hub)  # before any export work
    dest = export_checkpoint(ref, out)
    message = f"bert-mp export of {Path(ref).name}" + (f" ({revision})" if revision else "")
    url = push_folder(dest, push_to_hub, revision, private, message)
    print(f"bert-mp export: {dest} -> {push_to_hub}{f'@{revision}' if revision else ''} ({url})")
    return 0
