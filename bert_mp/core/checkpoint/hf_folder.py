"""Hugging Face folders out of bert_mp runs: the tokenizer's length limit, a model card, and weight
checksums (``bert-mp export`` itself is :mod:`bert_mp.pretrain.export`).

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

from bert_mp.core.storage import checksums as integrity
from bert_mp.errors import ConfigError

CARD = "README.md"
CHECKSUMS = "checksums.json"
"""The weight files of an export with their sizes and digests (an :mod:`bert_mp.core.storage.checksums` manifest)."""
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
