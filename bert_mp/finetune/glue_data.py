"""GLUE as the Hub keeps it: nyu-mll/glue's parquet files, read from the Hub or from a local copy.

The Hub's layout is one folder per task and one file per split,
``<root>/<task>/<split>-00000-of-00001.parquet``, with the dataset's own column names, a
``ClassLabel`` (or, for STS-B, a float) ``label`` and -1 for the hidden test labels. The same
path function serves both sources - ``hf://datasets/nyu-mll/glue`` or a local folder - and both are
read by one call, ``datasets.load_dataset("parquet", data_files=...)``: a local copy is read
exactly as the Hub is, and the tests drive the Hub path up to that call.

Each task records what GLUE reports for it and which figure its average takes (the BERT paper's
convention: F1 for MRPC and QQP, Spearman for STS-B, MCC for CoLA, accuracy elsewhere; MNLI's
matched and mismatched accuracies both count; WNLI is left out).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bert_mp.errors import ConfigError, DataError

GLUE_REPO = "nyu-mll/glue"
HUB_ROOT = f"hf://datasets/{GLUE_REPO}"
"""The Hub's copy, read through ``huggingface_hub``'s file system (``datasets`` resolves ``hf://``)."""
SHARD = "-00000-of-00001.parquet"


@dataclass(frozen=True)
class GlueTask:
    """One GLUE task: its columns, its evaluation splits, the figures it reports and the one the
    average takes."""

    name: str
    text: str
    pair: str | None
    eval_splits: tuple[str, ...]
    """Labelled evaluation splits, the one fine-tuning validates on first (GLUE's test labels are hidden)."""
    metrics: tuple[str, ...]
    """What the GLUE table reports, in the papers' order (``f1`` is the positive class's F1)."""
    score: str
    """The figure the GLUE average takes."""
    regression: bool = False

    def files(self, root: str) -> dict[str, str]:
        """Split -> the parquet file that holds it under ``root`` (a folder, or :data:`HUB_ROOT`)."""
        return {s: f"{root.rstrip('/')}/{self.name}/{s}{SHARD}" for s in ("train", *self.eval_splits)}


def _task(
    name: str,
    text: str,
    pair: str | None,
    metrics: tuple[str, ...],
    score: str | None = None,
    eval_splits: tuple[str, ...] = ("validation",),
    regression: bool = False,
) -> GlueTask:
    return GlueTask(name, text, pair, eval_splits, metrics, score or metrics[0], regression)


GLUE_TASKS: dict[str, GlueTask] = {
    t.name: t
    for t in (
        _task("cola", "sentence", None, ("mcc",)),
        _task("sst2", "sentence", None, ("accuracy",)),
        _task("mrpc", "sentence1", "sentence2", ("f1", "accuracy")),
        _task("qqp", "question1", "question2", ("f1", "accuracy")),
        _task("stsb", "sentence1", "sentence2", ("pearson", "spearman"), "spearman", regression=True),
        _task(
            "mnli",
            "premise",
            "hypothesis",
            ("accuracy",),
            eval_splits=("validation_matched", "validation_mismatched"),
        ),
        _task("qnli", "question", "sentence", ("accuracy",)),
        _task("rte", "sentence1", "sentence2", ("accuracy",)),
        _task("wnli", "sentence1", "sentence2", ("accuracy",)),
    )
}
"""The fine-tunable GLUE tasks (``ax``, the diagnostic set, has test labels only; ``mnli_matched`` and
``mnli_mismatched`` are MNLI's evaluation splits alone, which ``mnli`` reads)."""
AVERAGE_EXCLUDES = ("wnli",)
"""Left out of the GLUE average, as the BERT paper does (its construction is flawed: every system
submitted to GLUE scored below the 65.1% majority baseline)."""


def glue_task(task: str, key: str = "finetune.task") -> GlueTask:
    """The GLUE task ``name`` or ``glue/name`` names; an unknown one is one line naming ``key``."""
    name = task.removeprefix("glue/")
    if name not in GLUE_TASKS:
        raise ConfigError(f"{key}: unknown GLUE task {name!r}; choose from {', '.join(GLUE_TASKS)}")
    return GLUE_TASKS[name]


def check_local_copy(root: str | Path, tasks: list[str], key: str) -> None:
    """Every file the ``tasks`` read is in the local copy ``root`` - before any training, the first
    missing one named with the layout it is looked for in."""
    folder = Path(root).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"{key}: no such folder: {root}")
    for name in tasks:
        for split, path in glue_task(name, key).files(str(folder)).items():
            if not Path(path).is_file():
                raise ConfigError(
                    f"{key}: {root} has no {name}/{Path(path).name} (the {split} split of {name}); copy "
                    f"{GLUE_REPO}'s {name}/ folder there (the Hub's layout: <dir>/<task>/<split>{SHARD}) "
                    f"or leave {name} out"
                )


def load_glue(task: GlueTask, root: str | None) -> Any:
    """The task's train and evaluation splits as a ``datasets.DatasetDict``, from the local copy
    ``root`` or (None) the Hub. The first evaluation split is named ``validation``; others keep
    their names (MNLI's ``validation_mismatched``)."""
    import datasets

    source = str(Path(root).expanduser()) if root else HUB_ROOT
    files = task.files(source)
    try:
        loaded = datasets.load_dataset("parquet", data_files=files)
    except Exception as e:  # offline, a torn file, a missing one on the Hub: the message says which
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        where = f"the local copy {root}" if root else f"the Hub ({HUB_ROOT})"
        hint = (
            ""
            if root
            else "; no network? give a local copy of it: finetune.glue_data=DIR (bert-mp glue --data)"
        )
        raise DataError(f"cannot read GLUE {task.name} from {where}: {first}{hint}") from None
    first_eval = task.eval_splits[0]
    return datasets.DatasetDict({("validation" if s == first_eval else s): ds for s, ds in loaded.items()})
