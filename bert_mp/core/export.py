"""Hugging Face folders out of bert_mp runs: the tokenizer's length limit, a model card, and
``bert-mp export RUN_OR_CHECKPOINT``.

Every folder bert_mp writes for other tools (pretraining ``final/``, fine-tuning ``final/``, and
``bert-mp export``) goes through :func:`finish_hf_folder`: the tokenizer gets
``model_max_length`` = the model's position embeddings (so ``pipeline(..., truncation=True)`` cuts
long inputs instead of crashing), the folder gets a ``README.md`` model card saying what it is,
what it was trained on, how, and how to load it, and ``checksums.json`` with the size and xxh3-128
digest of its weight files, which bert_mp verifies before it loads the folder again
(``finetune.checkpoint``, ``model.init_from``, ``bert-mp predict``). The card, config and tokenizer
are not covered: they are meant to be edited.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bert_mp.core import integrity, storage
from bert_mp.errors import ConfigError

CARD = "README.md"
CHECKSUMS = "checksums.json"
"""The weight files of an export with their sizes and digests (an :mod:`bert_mp.core.integrity` manifest)."""
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")
_CARD_TASK = {"pretraining": "fill-mask", "classification": "text-classification"}


def set_tokenizer_max_length(folder: Path, max_length: int) -> None:
    """Write ``model_max_length`` into a saved tokenizer's ``tokenizer_config.json`` (never above the model's)."""
    path = Path(folder) / "tokenizer_config.json"
    if not path.is_file():
        return
    conf = json.loads(path.read_text(encoding="utf-8"))
    current = conf.get("model_max_length")
    if not isinstance(current, (int, float)) or current > max_length:
        conf["model_max_length"] = int(max_length)
        path.write_text(json.dumps(conf, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _rows(facts: dict[str, Any]) -> str:
    return "\n".join(f"| {k} | {v} |" for k, v in facts.items() if v not in (None, "", {}))


def model_card(kind: str, facts: dict[str, Any], load: str) -> str:
    """A short model card: front matter for the Hub, a table of facts, and how to load the folder."""
    front = (
        f"---\nlibrary_name: transformers\npipeline_tag: {_CARD_TASK[kind]}\ntags:\n- bert\n- bert_mp\n---\n"
    )
    title = "BERT pretrained with bert_mp" if kind == "pretraining" else "BERT fine-tuned with bert_mp"
    return (
        f"{front}\n# {title}\n\n| | |\n| --- | --- |\n{_rows(facts)}\n\n## Loading\n\n```python\n{load}\n```\n"
        "\nNo custom code: plain `transformers`. The tokenizer's `model_max_length` is the length to cut at "
        "(the model's position limit; for a fine-tuned model, its fine-tuning length), so `truncation=True` "
        "cuts longer inputs there.\n"
    )


_LOAD = {
    "pretraining": (
        "from transformers import AutoTokenizer, BertForPreTraining, BertForSequenceClassification, pipeline\n"
        'tok = AutoTokenizer.from_pretrained("{path}")\n'
        'model = BertForPreTraining.from_pretrained("{path}")\n'
        'clf = BertForSequenceClassification.from_pretrained("{path}", num_labels=2)  # to fine-tune\n'
        'fill = pipeline("fill-mask", model="{path}")'
    ),
    "classification": (
        "from transformers import pipeline\n"
        'clf = pipeline("text-classification", model="{path}", truncation=True)\n'
        'clf("some text")'
    ),
}


def finish_hf_folder(folder: Path, kind: str, max_positions: int, facts: dict[str, Any]) -> None:
    """The tokenizer length limit, the model card and the weight checksums of a ``save_pretrained`` folder."""
    folder = Path(folder)
    set_tokenizer_max_length(folder, max_positions)
    card = model_card(kind, facts, _LOAD[kind].format(path=folder.name))
    (folder / CARD).write_text(card, encoding="utf-8")
    integrity.write_manifest(folder, CHECKSUMS, only=lambda rel: rel.endswith(_WEIGHT_SUFFIXES))


def verify_export(folder: str | Path, key: str) -> None:
    """Before loading a Hugging Face folder: when bert_mp wrote it (it has ``checksums.json``), its
    weights must match their digests; else :class:`ConfigError` naming ``key`` and the file."""
    folder = Path(folder)
    if not (folder / CHECKSUMS).is_file():
        return  # not written by bert_mp (or before checksums): nothing recorded to compare with
    problem = integrity.check(folder, CHECKSUMS, "", CHECKSUMS).problem
    if problem:
        raise ConfigError(
            f"{key}: {folder}: {problem}; export it again from its run (bert-mp export RUN_FOLDER)"
        )


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


# --------------------------------------------------------------------------------------------------
# bert-mp export
# --------------------------------------------------------------------------------------------------
def locate_checkpoint(ref: str | Path) -> tuple[Path, Path]:
    """``(checkpoint folder, run folder)`` for a run folder (its newest complete checkpoint) or a checkpoint."""
    from bert_mp.core import checkpoint as ckpt

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


def export_checkpoint(ref: str | Path, out: str | Path | None = None) -> Path:
    """Rebuild ``BertForPreTraining`` from a checkpoint and write a Hugging Face folder (default ``<run>/export-step_N``).

    The checkpoint is verified (sizes and digests) before any of it is read; the folder is written
    atomically, and a full disk ends in one line (:class:`bert_mp.errors.StorageError`).
    """
    import warnings

    from transformers import AutoTokenizer, BertConfig, BertForPreTraining
    from transformers.utils import logging as hf_logging

    from bert_mp.core import checkpoint as ckpt
    from bert_mp.core.config import load_config
    from bert_mp.data.prepare import cache_path
    from bert_mp.errors import BertMPWarning, TrainingError
    from bert_mp.model.bert import bert_config

    hf_logging.disable_progress_bar()  # a "Writing model shards" bar is noise in a one-shot command
    folder, run = locate_checkpoint(ref)
    if not (run / "config.yaml").is_file():
        raise ConfigError(
            f"{run}: no config.yaml (the checkpoint's run folder is needed to rebuild the model)"
        )
    if not ckpt.is_hashed(folder):
        warnings.warn(ckpt.size_only_note(folder), BertMPWarning, stacklevel=2)
    try:
        loop_state = ckpt.read_loop_state(folder)
    except TrainingError as e:
        raise ConfigError(str(e)) from None
    cfg = load_config(run / "config.yaml")
    summary_path = run / "summary.json"
    summary = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.is_file() else {}
    data = Path(summary.get("data", {}).get("path") or cache_path(cfg.data))
    if not (data / "tokenizer").is_dir():
        raise ConfigError(
            f"{data}: the run's prepared data (its tokenizer) is gone; run `bert-mp prepare {run / 'config.yaml'}` first"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(data / "tokenizer"))
    model_conf = summary.get("model", {}).get("config")
    if model_conf:
        bcfg = BertConfig(**model_conf)
    else:
        stats = json.loads((data / "stats.json").read_text(encoding="utf-8"))
        bcfg = bert_config(
            cfg.model, int(cfg.model.vocab_size or stats["model_vocab_size"]), tokenizer.pad_token_id
        )
    model = _checkpoint_model(folder, BertForPreTraining(bcfg))
    step = loop_state["step"]
    dest = Path(out) if out else run / f"export-{folder.name}"
    data_facts = {
        "fingerprint": (loop_state.get("meta") or {}).get("data_fingerprint"),
        **summary.get("data", {}),
    }
    evaluation, eval_step = evaluation_at(run, step)
    facts = pretraining_facts(cfg, step, cfg.train.precision, evaluation, data_facts)
    if evaluation and eval_step != step:
        facts["evaluated"] = f"at step {eval_step} (the last evaluation before this checkpoint)"
    facts["checkpoint"] = f"{folder.name} of {run.name} (exported with bert-mp export)"

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        finish_hf_folder(tmp, "pretraining", bcfg.max_position_embeddings, facts)

    needed = sum(p.numel() * p.element_size() for p in model.parameters())
    storage.write_folder_atomically(
        dest,
        write,
        "the export",
        needed,
        lambda: f"{folder} is untouched. Free disk space and run bert-mp export again",
    )
    return dest


def evaluation_at(run: Path, step: int) -> tuple[dict | None, int | None]:
    """The run's evaluation at ``step`` (else its last one before it) from metrics.jsonl, and its step."""
    from bert_mp.core.io import read_jsonl

    path = Path(run) / "metrics.jsonl"
    rows = read_jsonl(path) if path.is_file() else []
    evals = [r for r in rows if r.get("kind") == "eval" and int(r.get("step", 0)) <= step]
    if not evals:
        return None, None
    last = max(evals, key=lambda r: int(r["step"]))  # the last row of that step: a resume re-evaluates
    same = [r for r in evals if r["step"] == last["step"]]
    return same[-1], int(last["step"])


def _checkpoint_model(folder: Path, model: Any) -> Any:
    """``model`` with the weights of a verified checkpoint's ``model.safetensors`` (keys HF-native)."""
    from bert_mp.core.state_io import StateFileError, read_safetensors

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


def command(ref: str, out: str | None = None) -> int:
    dest = export_checkpoint(ref, out)
    print(f"bert-mp export: {dest} (loads with BertForPreTraining.from_pretrained)")
    return 0
