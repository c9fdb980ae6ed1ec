"""The classifier fine-tuning starts from: checkpoint and tokenizer resolution, and the model.

``finetune.checkpoint`` (a bert_mp ``final/`` folder, a run folder, any BERT folder, or a Hub name) and
``finetune.tokenizer`` are checked before any data work; :func:`build_classifier` loads
``BertForSequenceClassification`` from the checkpoint and records which weights are new and which
went unused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bert_mp.core.checkpoint.hf_folder import verify_export
from bert_mp.core.storage.files import looks_like_local_path
from bert_mp.errors import ConfigError
from bert_mp.finetune.tasks import LabelSpace
from bert_mp.model.hub import resolve_hub_model

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


def resolve_checkpoint(ref: str | None) -> str:
    """A local BERT folder (a train run folder means its ``final/``) or a Hub name, checked early.

    A reference that looks local and is no folder fails at once; any other gets one quick question to
    the Hub (:func:`bert_mp.model.hub.resolve_hub_model`), never a wait on retries. Needs no
    model library for a local folder (the CLI calls it before the command's libraries load).
    """
    if not ref:
        raise ConfigError(
            "finetune.checkpoint: set it to an exported folder (e.g. runs/train/final), a BERT checkpoint "
            "folder, or a Hub name such as google-bert/bert-base-uncased"
        )
    path = Path(ref).expanduser()
    if not path.is_dir():
        if path.exists() or looks_like_local_path(ref):
            raise ConfigError(
                f"finetune.checkpoint: {ref} is not a folder"
                if path.exists()
                else f"finetune.checkpoint: no such folder: {ref}"
            )
        found = resolve_hub_model(ref, "finetune.checkpoint")
        if found == ref:
            from transformers import AutoConfig

            _check_model_type(ref, AutoConfig.from_pretrained(ref).model_type)
            return ref
        path = Path(found)  # the Hub is out of reach; its cached copy is a local folder
    return _check_local_checkpoint(path, ref)


def _check_local_checkpoint(path: Path, ref: str) -> str:
    """A folder given as ``finetune.checkpoint``: config.json, weights, model type (a run folder: its final/)."""
    if not (path / "config.json").is_file() and (path / "final" / "config.json").is_file():
        path = path / "final"
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"finetune.checkpoint: {ref} is not a BERT checkpoint (no config.json); {_instead(path)}"
        )
    if not any((path / f).is_file() for f in _WEIGHT_FILES):
        raise ConfigError(
            f"finetune.checkpoint: {path} has a config.json but no weights ({', '.join(_WEIGHT_FILES[::2])})"
        )
    try:
        model_type = json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"finetune.checkpoint: {path}/config.json is not valid JSON ({e})") from None
    _check_model_type(str(path), model_type)
    verify_export(path, "finetune.checkpoint")
    return str(path)


def _instead(path: Path) -> str:
    """What to point finetune.checkpoint at instead of a folder without config.json.

    A training checkpoint (``<run>/checkpoints/step_N``) holds resumable state, not a model folder: name
    the run's ``final/`` where it has one, else the command that exports the checkpoint.
    """
    if path.name.startswith("step_") or (path / "loop_state.json").is_file():
        run = path.parent.parent
        export = f"`bert-mp export {path}` writes this step as {run / ('export-' + path.name)}"
        if (run / "final" / "config.json").is_file():
            return f"it is a training checkpoint: use the run's export {run / 'final'}, or {export}"
        return f"it is a training checkpoint: {export}; use that folder"
    return "point it at a save_pretrained folder such as <train.output_dir>/final"


def _check_model_type(ref: str, model_type: Any) -> None:
    if model_type != "bert":
        raise ConfigError(
            f"finetune.checkpoint: {ref} is a {model_type!r} checkpoint; bert-mp finetune loads BERT (model_type bert)"
        )


def resolve_tokenizer(ref: str) -> str:
    """``finetune.tokenizer``: a local folder, or a Hub name asked about once (as for the checkpoint)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists() or looks_like_local_path(ref):
        raise ConfigError(f"finetune.tokenizer: no such folder: {ref}")
    return resolve_hub_model(ref, "finetune.tokenizer", "tokenizer_config.json")


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
    """``BertForSequenceClassification`` from the checkpoint (or its architecture, freshly initialised);
    a regression label space (STS-B) gives it one output and ``problem_type="regression"``.

    Returns the model and the loading record: weights newly initialised and checkpoint weights unused.
    """
    from transformers import BertConfig, BertForSequenceClassification, set_seed

    head = {"num_labels": labels.size, "id2label": labels.id2label(), "label2id": labels.label2id()}
    if labels.regression:  # one output and a squared-error loss, as transformers reads problem_type
        head["problem_type"] = "regression"
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


ClassifierBuilder = Callable[..., tuple[Any, dict]]
"""``build_classifier(checkpoint, labels, init, seed) -> (model, loading record)``."""
