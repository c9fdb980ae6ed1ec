"""``bert-mp glue CHECKPOINT [CONFIG] [--data DIR] [--tasks cola,rte,...] [key=value ...]``: the GLUE
suite in one command.

Each task is one ``bert-mp finetune`` run (the same loop, in this process) into
``<glue.output_dir>/<task>/``, with the finetune section as the recipe, the task's entry of
``glue.recipes`` over it and the command line's overrides on top; STS-B trains as a regression.
After every task ``glue.json`` and ``glue.md`` are rewritten - per task its GLUE metrics on the
labelled validation split(s) and the figure the average takes, then the average - so a suite
stopped anywhere is resumed by running the same command again: a task that completed (with the
same config) is kept, an interrupted one resumes from its checkpoint.

The average is the BERT paper's (Devlin et al. 2019, Table 1): the mean of MNLI-m, MNLI-mm, QQP
(F1), QNLI, SST-2, CoLA (MCC), STS-B (Spearman), MRPC (F1) and RTE - nine figures, WNLI left out -
on a 0-100 scale. Its BERT-base row (84.6, 83.4, 71.2, 90.5, 93.5, 52.1, 85.8, 88.9, 66.4) averages to
the 79.6 it prints, which pins the convention down. GLUE's test labels are hidden, so the figures
here are validation figures, as MosaicBERT's and ModernBERT's GLUE tables are.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from bert_mp.core.config import GLUE_SUITE, Config, config_from_layers, load_yaml
from bert_mp.core.process import console
from bert_mp.core.process.hold import hold
from bert_mp.core.process.run_dir import hold_folder, read_summary, saved_config
from bert_mp.core.storage.files import atomic_write_json, atomic_write_text
from bert_mp.finetune.glue_args import GlueRequest
from bert_mp.finetune.glue_data import AVERAGE_EXCLUDES, GlueTask, check_local_copy, glue_task
from bert_mp.finetune.rerun import RESUME, folder_action

RESULTS = "glue.json"
TABLE = "glue.md"
CONVENTION = (
    "BERT paper (Devlin et al. 2019, Table 1): mean of MNLI-m, MNLI-mm, QQP F1, QNLI, SST-2, CoLA MCC, "
    "STS-B Spearman, MRPC F1 and RTE (x100), WNLI left out; validation splits (GLUE's test labels are hidden)"
)
TITLES = {
    "cola": "CoLA",
    "sst2": "SST-2",
    "mrpc": "MRPC",
    "qqp": "QQP",
    "stsb": "STS-B",
    "mnli": "MNLI",
    "qnli": "QNLI",
    "rte": "RTE",
    "wnli": "WNLI",
}
METRIC_TITLES = {
    "mcc": "MCC",
    "f1": "F1",
    "accuracy": "accuracy",
    "pearson": "Pearson",
    "spearman": "Spearman",
}
RECIPE_KEYS = ("learning_rate", "batch_size", "epochs", "max_steps", "max_seq_length", "warmup_ratio", "seed")


# --------------------------------------------------------------------------------------------------
# each task: its config, whether it is done, its run
# --------------------------------------------------------------------------------------------------
def task_config(req: GlueRequest, task: str, extra: list[str] = ()) -> Config:
    """One task's fine-tuning config: the recipe file, the task's ``glue.recipes`` entry, then every
    override, then the task and its folder."""
    layers = [load_yaml(req.config)] if req.config else []
    recipe = req.cfg.glue.recipes.get(task)
    if recipe:
        layers.append(OmegaConf.create({"finetune": dict(recipe)}))
    out = Path(req.cfg.glue.output_dir) / task
    return config_from_layers(
        layers, [*req.overrides, f"finetune.task=glue/{task}", f"finetune.output_dir={out}", *extra]
    )


def run_task(req: GlueRequest, task: str, label: str) -> tuple[dict[str, Any], bool]:
    """Fine-tune one task (or keep its finished run): its summary.json, and whether it trained now."""
    from bert_mp.finetune.trainer import run_finetune

    cfg = task_config(req, task)
    action, why = folder_action(cfg)
    if action == "keep":
        console.show(f"bert-mp glue: {label}: {why}, kept")
        return read_summary(cfg.finetune.output_dir) or {}, False
    if action != "fresh":
        console.show(
            f"bert-mp glue: {label}: {why}; {'resuming' if action == 'resume' else 'training it again'}"
        )
    cfg = task_config(req, task, RESUME.get(action, []))
    ft = cfg.finetune
    console.show(
        f"bert-mp glue: {label}: fine-tuning (lr {ft.learning_rate:g}, batch {ft.batch_size}, "
        f"{f'{ft.max_steps} steps' if ft.max_steps else f'{ft.epochs} epochs'}, {ft.precision}) -> {ft.output_dir}"
    )
    return run_finetune(cfg), True


# --------------------------------------------------------------------------------------------------
# the GLUE figures of a finished task, and the average
# --------------------------------------------------------------------------------------------------
def split_metrics(spec: GlueTask, m: dict[str, Any], labels: list[str]) -> dict[str, float | None]:
    """A split's GLUE metrics from fine-tuning's evaluation: ``f1`` is the F1 of the positive class
    (class id 1: MRPC's ``equivalent``, QQP's ``duplicate``), as scikit-learn's binary F1 counts it."""
    out: dict[str, float | None] = {}
    for key in spec.metrics:
        if key == "f1":
            out[key] = m["per_class_f1"].get(labels[1], 0.0)  # absent: never in labels nor predictions
        else:
            out[key] = m[key]
    return out


def task_result(spec: GlueTask, summary: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A task's entry of glue.json: status, its metrics per evaluation split, the figures the average
    takes (x100), the recipe and what it cost."""
    entry: dict[str, Any] = {"status": summary.get("status"), "run": str(folder)}
    if summary.get("status") != "completed":
        entry["error"] = summary.get("error") or summary.get("stop_reason")
        return entry
    labels = summary["task"]["labels"]
    evaluated = {"validation": summary["validation"], **summary.get("other_splits", {})}
    splits = {}
    for i, split in enumerate(spec.eval_splits):
        m = evaluated["validation" if i == 0 else split]
        splits[split] = {**split_metrics(spec, m, labels), "examples": m["examples"]}
    names = [TITLES[spec.name]] if len(spec.eval_splits) == 1 else ["MNLI-m", "MNLI-mm"]
    scores = {n: 100 * splits[s][spec.score] for n, s in zip(names, spec.eval_splits)}
    cfg = saved_config(folder)
    entry.update(
        splits=splits,
        scores=scores,
        score_metric=spec.score,
        steps=summary.get("steps"),
        train_s=summary.get("train_elapsed_s"),
        precision=(summary.get("precision") or {}).get("name"),
        recipe={k: cfg["finetune"].get(k) for k in RECIPE_KEYS} if cfg else None,
    )
    return entry


def average(tasks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The GLUE average of the finished tasks (WNLI excluded), and whether it is the whole suite's."""
    scores = {
        name: v
        for task, entry in tasks.items()
        if task not in AVERAGE_EXCLUDES
        for name, v in (entry.get("scores") or {}).items()
    }
    want = [n for t in GLUE_SUITE for n in (["MNLI-m", "MNLI-mm"] if t == "mnli" else [TITLES[t]])]
    return {
        "average": sum(scores.values()) / len(scores) if scores else None,
        "average_of": list(scores),
        "complete": set(want) <= set(scores),
        "missing": [n for n in want if n not in scores],
    }


# --------------------------------------------------------------------------------------------------
# glue.json, glue.md, the console table
# --------------------------------------------------------------------------------------------------
def table_rows(tasks: dict[str, dict[str, Any]]) -> list[list[str]]:
    rows = []
    for task, entry in tasks.items():
        spec = glue_task(task)
        metric = "/".join(METRIC_TITLES[k] for k in spec.metrics)
        if entry.get("status") != "completed":
            rows.append(
                [TITLES[task], metric, "-", entry.get("status") or "not run", entry.get("error") or ""]
            )
            continue
        for split, m in entry["splits"].items():
            name = TITLES[task] + (
                {"validation_matched": "-m", "validation_mismatched": "-mm"}.get(split, "")
            )
            values = "/".join(_pct(m[k]) for k in spec.metrics)
            note = (
                "not averaged (BERT's convention)" if task in AVERAGE_EXCLUDES else f"{entry['steps']} steps"
            )
            rows.append([name, metric, values, str(m["examples"]), note])
    return rows


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def average_line(avg: dict[str, Any]) -> str:
    if avg["average"] is None:
        return "GLUE average: n/a (no task finished)"
    if avg["complete"]:
        return f"GLUE average: {avg['average']:.1f} (the BERT paper's nine figures, WNLI left out)"
    return (
        f"average of {len(avg['average_of'])} figures: {avg['average']:.1f} - not the GLUE average "
        f"({', '.join(avg['missing'])} missing)"
    )


def write_results(root: Path, req: GlueRequest, tasks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """glue.json and glue.md as they stand (after every task: nothing finished is lost)."""
    avg = average(tasks)
    data = {
        "checkpoint": req.cfg.finetune.checkpoint,
        "recipe": req.config,
        "data": req.cfg.finetune.glue_data or "hf://datasets/nyu-mll/glue",
        "convention": CONVENTION,
        "tasks": tasks,
        **avg,
    }
    atomic_write_json(root / RESULTS, data)
    headers = ["task", "metric", "validation (x100)", "examples", "note"]
    lines = [
        "# GLUE",
        "",
        f"Checkpoint `{data['checkpoint']}`; recipe `{req.config or 'the finetune defaults'}`; data `{data['data']}`.",
        "",
        "| " + " | ".join(headers) + " |",
        "| " + " | ".join("---" for _ in headers) + " |",
        *("| " + " | ".join(row) + " |" for row in table_rows(tasks)),
        "",
        f"**{average_line(avg)}**. Convention: {CONVENTION}.",
        "",
    ]
    atomic_write_text(root / TABLE, "\n".join(lines))
    return data


def show_table(data: dict[str, Any]) -> None:
    rows = [["task", "metric", "x100", "examples", ""], *table_rows(data["tasks"])]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        console.show("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4])
    console.show(f"  {average_line(data)}")


# --------------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------------
def check_before_training(req: GlueRequest) -> None:
    """Every mistake the suite can know of before its first step: the checkpoint is a BERT (and the
    tokenizer, if named, exists), and a local copy holds every file the tasks read."""
    from bert_mp.finetune.model import resolve_checkpoint, resolve_tokenizer

    ft = req.cfg.finetune
    resolve_checkpoint(ft.checkpoint)
    if ft.tokenizer:
        resolve_tokenizer(ft.tokenizer)
    if ft.glue_data:
        check_local_copy(ft.glue_data, req.cfg.glue.tasks, "--data (finetune.glue_data)")


def run_suite(req: GlueRequest) -> tuple[int, dict[str, Any]]:
    """Every task in turn; after each, the results so far and the hold point ``glue:<N>`` (N: the
    task's place in the suite, 1-based). Stops at the first task that does not complete."""
    from bert_mp.core.loop.state import exit_code

    root = Path(req.cfg.glue.output_dir)
    names = req.cfg.glue.tasks
    tasks: dict[str, dict[str, Any]] = {t: {"status": "pending"} for t in names}
    data: dict[str, Any] = {}
    for i, task in enumerate(names, 1):
        t0 = time.perf_counter()
        summary, trained = run_task(req, task, f"[{i}/{len(names)}] {task}")
        tasks[task] = task_result(glue_task(task), summary, root / task)
        data = write_results(root, req, tasks)
        if summary.get("status") != "completed":
            why = summary.get("stop_reason") or summary.get("error") or summary.get("status")
            console.show(
                f"bert-mp glue: {task} {summary.get('status')} after {summary.get('steps')} steps ({why}) -> "
                f"{root / task}; run the same command again to resume the suite (finished tasks are kept)"
            )
            return exit_code(summary), data
        scores = ", ".join(f"{k} {v:.1f}" for k, v in tasks[task]["scores"].items())
        took = f" ({time.perf_counter() - t0:.1f} s)" if trained else ""
        console.show(f"bert-mp glue: [{i}/{len(names)}] {task}: {scores}{took}")
        hold("glue", i)
    return 0, data


def command(req: GlueRequest) -> int:
    """CLI entry: ``bert-mp glue CHECKPOINT [CONFIG] [--data DIR] [--tasks ...] [key=value ...]``."""
    check_before_training(req)
    root = Path(req.cfg.glue.output_dir)
    with hold_folder(root, "glue.output_dir", "GLUE suite"):
        code, data = run_suite(req)
    if code == 0:
        console.show(f"bert-mp glue: {root / RESULTS} and {root / TABLE}")
        show_table(data)
    return code
