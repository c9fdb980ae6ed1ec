"""Downstream classification tasks for ``bert-mp finetune``: built-in, local files, Hub / GLUE.

Every loader returns a ``datasets.DatasetDict`` with the same columns - ``text``, optional
``text_pair``, ``label`` (raw values: strings or integers) - and a ``stats`` dict of what was dropped
or counted, so fine-tuning never needs to know where the data came from.

The built-in tasks label stdlib docstrings with real metadata (the top-level package a docstring
belongs to, or whether it documents a module, class or function). Their split is fixed and split by
module: all docstrings of one module land in one split, and a text that occurs in an earlier split is
dropped from the later ones, so no document leaks across splits.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import datasets

from bert_mp.core.config import FinetuneConfig
from bert_mp.data.builtin_corpus import Docstring, iter_stdlib_docstrings
from bert_mp.errors import ConfigError, DataError
from bert_mp.finetune.glue_data import glue_task, load_glue

SPLITS = ("train", "validation", "test")
BUILTIN_FRACTIONS = {"train": 0.7, "validation": 0.15, "test": 0.15}
# Seed of the held-out validation split carved from train when none is given: fixed, so runs with
# different training seeds are evaluated on the same examples.
HOLDOUT_SEED = 0

_FORMATS = {
    ".csv": "csv",
    ".tsv": "csv",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".pq": "parquet",
}


@dataclass
class TaskData:
    """A loaded task: splits with ``text`` / ``text_pair`` / ``label`` columns and what was counted."""

    name: str
    splits: datasets.DatasetDict
    has_pair: bool
    stats: dict[str, Any] = field(default_factory=dict)
    columns: dict[str, str | None] = field(
        default_factory=lambda: {"text": "text", "text_pair": None, "label": "label"}
    )
    """The source's column names for text, text_pair and label (what a file for predict would use)."""
    regression: bool = False
    """The label is a score (STS-B), not a class: one output, a squared-error loss."""


# --------------------------------------------------------------------------------------------------
# built-in tasks (pure functions of the docstrings)
# --------------------------------------------------------------------------------------------------
def _stable_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _normalize(text: str) -> str:
    return " ".join(text.split()).lower()


def assign_modules(
    sizes: Mapping[str, int], fractions: Mapping[str, float] = BUILTIN_FRACTIONS
) -> dict[str, str]:
    """Assign whole modules to splits so each split gets close to its share of the examples.

    Largest modules first, each to the split furthest below its target (ties broken by a hash of the
    module name, so the result depends on neither dict order nor Python's hash seed). Afterwards an
    empty split takes the smallest module of the split with the most modules, so with at least as
    many modules as splits every split has one.
    """
    order = sorted(sizes, key=lambda m: (-sizes[m], _stable_hash(m)))
    total = sum(sizes.values())
    filled = dict.fromkeys(fractions, 0)
    out: dict[str, str] = {}
    for module in order:
        split = max(fractions, key=lambda s: fractions[s] * total - filled[s])
        out[module] = split
        filled[split] += sizes[module]
    for split in fractions:
        members = Counter(out.values())
        if members[split] or len(sizes) < len(fractions):
            continue
        donor = max(fractions, key=lambda s: members[s])
        smallest = min((m for m in order if out[m] == donor), key=lambda m: (sizes[m], _stable_hash(m)))
        out[smallest] = split
    return out


def _split_rows(rows: Sequence[dict], module_split: Mapping[str, str]) -> tuple[dict[str, list[dict]], int]:
    """Place rows by their module's split; drop a text already seen in an earlier split (counted)."""
    by_split: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for row in rows:
        by_split[module_split[row["module"]]].append(row)
    seen: set[str] = set()
    dropped = 0
    for split in SPLITS:
        kept = []
        for row in by_split[split]:
            key = _normalize(row["text"])
            if split != "train" and key in seen:
                dropped += 1
                continue
            kept.append(row)
        seen.update(_normalize(r["text"]) for r in kept)
        by_split[split] = kept
    return by_split, dropped


def builtin_package_rows(
    docstrings: Iterable[Docstring], min_modules: int = 4, min_examples: int = 100, min_words: int = 3
) -> tuple[dict[str, list[dict]], dict[str, Any]]:
    """Label = top-level stdlib package; only packages with enough modules and docstrings are classes.

    Each package's modules are split separately (``assign_modules``), so every class appears in
    every split while no module is in two splits.
    """
    rows = [
        {"text": d.text, "label": d.package, "module": d.module, "kind": d.kind}
        for d in docstrings
        if len(d.text.split()) >= min_words
    ]
    modules: dict[str, Counter] = defaultdict(Counter)
    for r in rows:
        modules[r["label"]][r["module"]] += 1
    classes = sorted(
        p for p, mods in modules.items() if len(mods) >= min_modules and sum(mods.values()) >= min_examples
    )
    if len(classes) < 2:
        raise DataError(
            f"built-in package task: only {len(classes)} stdlib package(s) have >= {min_modules} modules and "
            f">= {min_examples} docstrings; lower finetune.builtin_min_modules / finetune.builtin_min_examples"
        )
    module_split: dict[str, str] = {}
    for package in classes:
        module_split.update(assign_modules(modules[package]))
    chosen = [r for r in rows if r["module"] in module_split]
    by_split, dropped = _split_rows(chosen, module_split)
    stats = {
        "classes": classes,
        "docstrings_considered": len(rows),
        "docstrings_outside_classes": len(rows) - len(chosen),
        "duplicate_texts_dropped": dropped,
        "modules_per_split": {s: sum(1 for v in module_split.values() if v == s) for s in SPLITS},
    }
    return by_split, stats


def builtin_kind_rows(
    docstrings: Iterable[Docstring], min_words: int = 3
) -> tuple[dict[str, list[dict]], dict[str, Any]]:
    """Label = what the docstring documents: module, class or function. Split by module."""
    rows = [
        {"text": d.text, "label": d.kind, "module": d.module, "kind": d.kind}
        for d in docstrings
        if len(d.text.split()) >= min_words
    ]
    module_split = assign_modules(Counter(r["module"] for r in rows))
    by_split, dropped = _split_rows(rows, module_split)
    stats = {
        "classes": sorted({r["label"] for r in rows}),
        "docstrings_considered": len(rows),
        "duplicate_texts_dropped": dropped,
        "modules_per_split": {s: sum(1 for v in module_split.values() if v == s) for s in SPLITS},
    }
    return by_split, stats


def load_builtin(cfg: FinetuneConfig, root: Path | None = None) -> TaskData:
    """The built-in offline task named by ``cfg.task`` (stdlib docstrings of this Python)."""
    docstrings = iter_stdlib_docstrings(root)
    if cfg.task == "builtin-package":
        by_split, stats = builtin_package_rows(
            docstrings, cfg.builtin_min_modules, cfg.builtin_min_examples, cfg.builtin_min_words
        )
    else:
        by_split, stats = builtin_kind_rows(docstrings, cfg.builtin_min_words)
    features = datasets.Features(
        {name: datasets.Value("string") for name in ("text", "label", "module", "kind")}
    )
    splits = datasets.DatasetDict(
        {s: datasets.Dataset.from_list(by_split[s], features=features) for s in SPLITS}
    )
    return TaskData(cfg.task, splits, has_pair=False, stats=stats)


# --------------------------------------------------------------------------------------------------
# local files and the Hub
# --------------------------------------------------------------------------------------------------
def _file_format(path: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in _FORMATS:
        raise ConfigError(
            f"finetune data file {path}: unknown extension {suffix!r}; use .csv, .tsv, .jsonl, .json or .parquet"
        )
    return _FORMATS[suffix]


def read_table_file(path: str, key: str) -> datasets.Dataset:
    """One CSV / TSV / JSON Lines / Parquet file as a Dataset; problems name ``key`` and the file."""
    if not Path(path).is_file():
        raise ConfigError(f"{key}: file not found: {path}")
    fmt = _file_format(path)
    if Path(path).stat().st_size == 0:
        raise DataError(f"{key}: {path} is empty (0 bytes)")
    if fmt == "csv" and _at_most_one_line(path):  # before load_dataset, whose progress bar would print
        raise DataError(f"{key}: {path} has no data rows (a header at most)")
    kwargs = {"delimiter": "\t"} if Path(path).suffix.lower() == ".tsv" else {}
    try:
        ds = datasets.load_dataset(fmt, data_files={"rows": str(path)}, split="rows", **kwargs)
    except Exception as e:  # pyarrow / pandas raise many types for malformed files
        cause = e.__cause__ or e.__context__
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "corresponds to no data" in detail or (cause is not None and "No columns" in str(cause)):
            raise DataError(f"{key}: {path} has no data rows (a header at most)") from None
        if cause is not None and str(cause):
            detail = f"{detail}: {str(cause).splitlines()[0]}"
        raise DataError(f"{key}: cannot read {path} as {fmt}: {detail}") from None
    if len(ds) == 0:
        raise DataError(f"{key}: {path} has no data rows (a header at most)")
    return ds


def _at_most_one_line(path: str) -> bool:
    """Whether a text file has at most one non-blank line (reads no further than the second)."""
    with open(path, "rb") as f:
        lines = (line for line in f if line.strip())
        return next(lines, None) is None or next(lines, None) is None


def load_local(cfg: FinetuneConfig) -> datasets.DatasetDict:
    """CSV / JSON Lines / Parquet files (one per split) as a DatasetDict, columns untouched."""
    files = {"train": cfg.train_file, "validation": cfg.validation_file, "test": cfg.test_file}
    return datasets.DatasetDict(
        {split: read_table_file(path, f"finetune.{split}_file") for split, path in files.items() if path}
    )


def load_hub(name: str, config: str | None, splits: Mapping[str, str | None]) -> datasets.DatasetDict:
    """Named splits of a Hub dataset (or a local dataset folder) through ``datasets.load_dataset``."""
    try:
        loaded = datasets.load_dataset(name, config)
    except Exception as e:  # offline, unknown name, bad config: the message says which
        raise DataError(
            f"cannot load dataset {name!r}{f' ({config})' if config else ''}: {str(e).splitlines()[0]} "
            "(no network? set HF_DATASETS_OFFLINE=0, or use finetune.task=local with files)"
        ) from None
    out = {}
    for split, source in splits.items():
        if source is None:
            continue
        if source not in loaded:
            raise DataError(f"dataset {name!r} has no split {source!r}; it has {', '.join(loaded)}")
        out[split] = loaded[source]
    return datasets.DatasetDict(out)


def _normalize_columns(
    raw: datasets.DatasetDict, text: str, pair: str | None, label: str
) -> datasets.DatasetDict:
    """Keep and rename the task's columns to text / text_pair / label; name a missing one clearly."""
    wanted = {text: "text", label: "label"}
    if pair:
        wanted[pair] = "text_pair"
    out = {}
    for split, ds in raw.items():
        missing = [c for c in wanted if c not in ds.column_names]
        if missing:
            raise DataError(
                f"{split} data has no column {missing[0]!r} (columns: {', '.join(ds.column_names)}); "
                "set finetune.text_column / finetune.text_pair_column / finetune.label_column"
            )
        ds = ds.select_columns(list(wanted))
        renames = {k: v for k, v in wanted.items() if k != v}
        out[split] = ds.rename_columns(renames) if renames else ds
    return datasets.DatasetDict(out)


def _is_complete(row: dict, has_pair: bool, class_ids: bool, regression: bool) -> bool:
    return (
        row_problem(row["text"], row.get("text_pair"), row["label"], has_pair, class_ids, regression) is None
    )


def _drop_incomplete(
    splits: datasets.DatasetDict, label_names: Sequence[str] | None, regression: bool = False
) -> tuple[datasets.DatasetDict, dict]:
    """Drop the rows :func:`row_problem` refuses (GLUE marks hidden labels with -1); counted per split."""
    dropped = {}
    out = {}
    for split, ds in splits.items():
        rule = {
            "has_pair": "text_pair" in ds.column_names,
            "class_ids": label_names is not None,
            "regression": regression,
        }
        kept = ds.filter(_is_complete, fn_kwargs=rule)
        dropped[split] = len(ds) - len(kept)
        out[split] = kept
    return datasets.DatasetDict(out), dropped


def _holdout_validation(splits: datasets.DatasetDict, fraction: float) -> datasets.DatasetDict:
    train = splits["train"]
    if len(train) < 4:
        raise DataError(f"train has {len(train)} examples: too few to hold out a validation split")
    parts = train.train_test_split(test_size=fraction, seed=HOLDOUT_SEED)
    out = dict(splits)
    out["train"], out["validation"] = parts["train"], parts["test"]
    return datasets.DatasetDict(out)


def load_task(cfg: FinetuneConfig, builtin_root: Path | None = None) -> TaskData:
    """Load the task named by ``cfg.task`` with text / text_pair / label columns and counted drops."""
    if cfg.task.startswith("builtin-"):
        return load_builtin(cfg, builtin_root)
    text, pair, label = cfg.text_column, cfg.text_pair_column, cfg.label_column
    regression = False
    if cfg.task == "local":
        raw = load_local(cfg)
    elif cfg.task == "hub":
        raw = load_hub(
            cfg.hub_name,  # type: ignore[arg-type]  # validate() requires it for task=hub
            cfg.hub_config,
            {"train": cfg.train_split, "validation": cfg.validation_split, "test": cfg.test_split},
        )
    else:  # GLUE's test labels are hidden (-1): its labelled evaluation splits only
        glue = glue_task(cfg.task)
        text, pair, label, regression = glue.text, glue.pair, "label", glue.regression
        raw = load_glue(glue, cfg.glue_data)
    if "train" not in raw:
        raise DataError(f"task {cfg.task}: no training data")
    label_feature = raw["train"].features.get(label)
    label_names = label_feature.names if isinstance(label_feature, datasets.ClassLabel) else None
    splits = _normalize_columns(raw, text, pair, label)
    splits, dropped = _drop_incomplete(splits, label_names, regression)
    if "validation" not in splits:
        splits = _holdout_validation(splits, cfg.validation_fraction)
    stats: dict[str, Any] = {"rows_without_text_or_label_dropped": dropped}
    if label_names is not None:
        stats["label_names"] = list(label_names)
    columns = {"text": text, "text_pair": pair, "label": label}
    return TaskData(cfg.task, splits, pair is not None, stats, columns, regression)


# --------------------------------------------------------------------------------------------------
# rows and labels: the one set of rules bert-mp finetune and bert-mp predict share
# --------------------------------------------------------------------------------------------------
HIDDEN_LABEL = -1
"""A ``datasets.ClassLabel`` column's value for a hidden label (GLUE's test splits)."""
_WHOLE_NUMBER = re.compile(r"[+-]?\d+(\.0*)?")


def normalize_label(value: Any) -> Any:
    """A label as both commands compare it: None when missing, an int for any whole number, else the text.

    A CSV cell's type depends on its neighbours (a blank turns ``10`` into ``10.0``, a word turns it
    into ``"10"``), so whole-number floats and whole-number strings are the integer they spell.
    A fractional number is refused: classification, not regression.
    """
    if value is None or isinstance(value, bool):
        return None if value is None else int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if not value.is_integer():
            raise DataError(
                f"label {value!r} is not a class: bert-mp finetune does classification (labels must be "
                "strings or integers), not regression"
            )
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return None
        return int(float(text)) if _WHOLE_NUMBER.fullmatch(text) else value
    raise DataError(f"label {value!r} ({type(value).__name__}) is not a class: use strings or integers")


def row_problem(
    text: Any, pair: Any, label: Any, has_pair: bool, class_ids: bool, regression: bool = False
) -> str | None:
    """Why a row can be neither trained on nor scored (``text`` / ``text_pair`` / ``label`` missing), or None.

    Blank texts and missing labels (with ``class_ids``, a dataset ``ClassLabel``: also -1, hidden)
    make a row incomplete: fine-tuning drops it, predict predicts it but leaves it out of the metrics;
    both count it. A ``regression`` label is a finite number; -1 is hidden (STS-B's scores are 0-5).
    """
    if text is None or not str(text).strip():
        return "text"
    if has_pair and (pair is None or not str(pair).strip()):
        return "text_pair"
    if regression:
        number = isinstance(label, (int, float)) and not isinstance(label, bool) and math.isfinite(label)
        return None if number and label != HIDDEN_LABEL else "label"
    value = normalize_label(label)
    if value is None or (class_ids and value == HIDDEN_LABEL):
        return "label"
    return None


@dataclass
class LabelSpace:
    """Label values seen in train, in a fixed order; id = position. Unseen values get ids >= size."""

    values: list[Any]
    names: list[str]
    regression: bool = False
    """A score, not a class (STS-B): one output named ``score``, the label ids are the scores."""

    @classmethod
    def for_regression(cls) -> LabelSpace:
        return cls(["score"], ["score"], regression=True)

    @property
    def size(self) -> int:
        return len(self.values)

    def id2label(self) -> dict[int, str]:
        return dict(enumerate(self.names))

    def label2id(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.names)}

    def metric_names(self, unseen: Mapping[str, int]) -> dict[int, str]:
        """Class id -> name for metrics: the label names, then ``unseen:<label>`` for the ids
        :func:`encode_labels` gave unseen labels (in the order it met them)."""
        extra = {self.size + n: f"unseen:{label}" for n, label in enumerate(unseen)}
        return {**self.id2label(), **extra}


def build_label_space(train_labels: Sequence[Any], class_names: Sequence[str] | None = None) -> LabelSpace:
    """Classes from the training labels: sorted values (numbers numerically, strings by text).

    With ``class_names`` (a ``datasets.ClassLabel``) the integer ids and names are the dataset's own.
    """
    if class_names is not None:
        return LabelSpace(list(range(len(class_names))), [str(n) for n in class_names])
    values = {normalize_label(v) for v in train_labels} - {None}
    if len({type(v) for v in values}) > 1:
        raise DataError("the label column mixes strings and numbers; make it one type")
    if len(values) < 2:
        raise DataError(f"train has {len(values)} distinct label(s); classification needs at least 2")
    ordered = sorted(values)
    return LabelSpace(ordered, [str(v) for v in ordered])


def encode_labels(
    labels: Sequence[Any], space: LabelSpace, split: str, policy: str = "count"
) -> tuple[list[int], dict[str, int]]:
    """Map labels (normalised by :func:`normalize_label`) to ids; values absent from train get ids >=
    space.size, in the order first met, and are counted by label.

    A value matches a class by value, else by name (a file may spell a ``ClassLabel`` class by its
    name). ``policy="count"`` keeps unseen examples (the model cannot predict them, so they count as
    errors in accuracy and F1, and are excluded from the loss); ``"error"`` stops with the values found.
    """
    index = {v: i for i, v in enumerate(space.values)}
    by_name = {n: i for i, n in enumerate(space.names)}
    unseen: dict[str, int] = {}
    ids = []
    for raw in labels:
        v = normalize_label(raw)
        i = index.get(v, by_name.get(v) if isinstance(v, str) else None)
        if i is None:
            key = str(v)
            unseen[key] = unseen.get(key, 0) + 1
            i = space.size + list(unseen).index(key)
        ids.append(i)
    if unseen and policy == "error":
        shown = ", ".join(f"{k!r} x{n}" for k, n in sorted(unseen.items())[:5])
        raise DataError(
            f"{split} has labels never seen in train: {shown}; fix the data or set finetune.unseen_labels=count"
        )
    return ids, unseen


# --------------------------------------------------------------------------------------------------
# the fine-tuned folder's task record: what bert-mp predict needs to read files as fine-tuning did
# --------------------------------------------------------------------------------------------------
TASK_RECORD = "bert_mp_task.json"


@dataclass
class TaskRecord:
    """Written into a fine-tuned ``final/`` and read by ``bert-mp predict``: the columns, the length
    and the label space fine-tuning used, so predict reads a file the same way by default."""

    task: str
    text_column: str
    text_pair_column: str | None
    label_column: str
    max_seq_length: int
    label_values: list[Any]
    label_names: list[str]
    class_ids: bool
    """The labels are a dataset ``ClassLabel``'s ids (-1: hidden)."""

    def label_space(self) -> LabelSpace:
        return LabelSpace(list(self.label_values), list(self.label_names))

    def write(self, folder: Path) -> None:
        (Path(folder) / TASK_RECORD).write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def read(cls, folder: Path) -> TaskRecord | None:
        """The record in ``folder``, None where there is none (a model not fine-tuned by bert_mp)."""
        path = Path(folder) / TASK_RECORD
        if not path.is_file():
            return None
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{path}: not valid JSON ({e})") from None
        want = {f.name for f in fields(cls)}
        if not isinstance(d, dict) or set(d) != want:
            got = set(d) if isinstance(d, dict) else set()
            problem = ", ".join(
                [f"missing {k}" for k in sorted(want - got)] + [f"unknown {k}" for k in sorted(got - want)]
            )
            raise DataError(f"{path}: {problem or 'not an object'} (written by another bert_mp version?)")
        return cls(**d)


# --------------------------------------------------------------------------------------------------
# tokenisation
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
