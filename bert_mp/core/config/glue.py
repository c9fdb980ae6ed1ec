"""The ``glue`` section (``bert-mp glue``): which GLUE tasks to fine-tune and each task's recipe.

The task names live here, without the data code, so a mistyped one is refused while the config
loads (before torch is imported); :mod:`bert_mp.finetune.glue_data` gives them their columns,
splits and metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from bert_mp.core.config.checks import _check, _choice
from bert_mp.core.config.loops import FinetuneConfig

GLUE_TASK_NAMES = ("cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli")
"""The fine-tunable GLUE tasks (nyu-mll/glue's configurations with a train split)."""
GLUE_SUITE = ("cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte")
"""The tasks the BERT paper's GLUE average is taken over (WNLI left out)."""
PER_RUN_KEYS = ("task", "checkpoint", "output_dir", "resume", "overwrite_output_dir", "glue_data")
"""finetune keys ``bert-mp glue`` sets for each task itself (a recipe may not)."""


@dataclass
class GlueConfig:
    """``bert-mp glue``: the suite's folder, its tasks and the per-task recipe over the finetune section."""

    output_dir: str = "runs/glue"
    """Suite folder: glue.json, glue.md and one fine-tuning run folder per task (<output_dir>/<task>/)."""
    tasks: list[str] = field(default_factory=lambda: list(GLUE_SUITE))
    """The GLUE tasks to fine-tune, in order (bert-mp glue --tasks cola,rte): cola, sst2, mrpc, qqp,
    stsb (regression), mnli (matched and mismatched), qnli, rte, wnli. The default is the eight the
    BERT paper averages; wnli may run but never counts in the average."""
    recipes: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per task, the finetune keys that differ from the finetune section for that task (e.g.
    {rte: {learning_rate: 2.0e-5}}): the task's recipe. Overrides on the command line apply on top."""

    def validate(self) -> None:
        _check(bool(self.tasks), "glue.tasks", "needs at least one task", self.tasks)
        for i, t in enumerate(self.tasks):
            _choice(t, f"glue.tasks[{i}]", GLUE_TASK_NAMES)
        _check(len(set(self.tasks)) == len(self.tasks), "glue.tasks", "has duplicates", self.tasks)
        keys = {f.name for f in fields(FinetuneConfig)} - set(PER_RUN_KEYS)
        for task, recipe in self.recipes.items():
            _choice(task, "glue.recipes", GLUE_TASK_NAMES)
            for k in recipe:
                _check(
                    k in keys,
                    f"glue.recipes.{task}.{k}",
                    "is not a finetune key a task's recipe may set (bert-mp config finetune lists them; "
                    f"{', '.join(PER_RUN_KEYS)} are set per task by bert-mp glue)",
                    k,
                )
