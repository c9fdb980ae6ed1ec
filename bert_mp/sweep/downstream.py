"""``sweep.downstream``: every pretraining run's final checkpoint fine-tuned on each task, and each
precision judged by what its checkpoint is worth downstream.

After the pretraining runs, each run's ``final/`` is fine-tuned on every task of
``sweep.downstream.tasks`` with every seed of ``sweep.downstream.seeds``, by ``bert-mp finetune``
processes with one recipe - the sweep's finetune section, its precision included - the same for
every precision. A fine-tune that completed (with the same config, from the same checkpoint) is kept
when the sweep runs again; one that was stopped resumes from its checkpoint.

The verdict uses the loss verdict's rule and words (:func:`bert_mp.sweep.parity.check_deviation`):
per task, a metric (GLUE's figure for a GLUE task - F1 for MRPC / QQP, MCC for CoLA, Spearman for
STS-B, accuracy elsewhere -, macro-F1 otherwise; on the test split where the task has one, else on
validation) is averaged over the fine-tune seeds; the candidate's mean is compared with the fp32
reference run's mean, and the relative deviation is divided by the tolerance ``max(band, min_spread)``,
where the band is the relative width (max - min over the reference mean) of every fine-tune of the
two fp32 pretraining seeds. PASS at most ``warn_multiplier`` x, WARN up to ``fail_multiplier`` x,
FAIL above, or when the precision gave no checkpoint or its fine-tunes failed. Where the band cannot
be measured - the second fp32 seed's fine-tunes missing, the reference's not all finished, a reference
mean of 0 - the verdict is withheld (``n/a``) with the reason.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bert_mp.core.config import Config, load_config
from bert_mp.finetune.rerun import RESUME, folder_action
from bert_mp.sweep import parity
from bert_mp.sweep.record import FINAL_STATUSES, DownstreamEntry, FinetuneSummary, RunEntry, record_outcome

DOWNSTREAM_DIR = "downstream"


# --------------------------------------------------------------------------------------------------
# plan: one fine-tune per run, task and seed
# --------------------------------------------------------------------------------------------------
def task_slug(task: str) -> str:
    """A task as a folder name (``glue/cola`` -> ``glue-cola``)."""
    return task.replace("/", "-")


def plan_downstream(groups: list[Any], cfg: Config) -> list[DownstreamEntry]:
    """Every run of every group x task x seed, in the order the runs were planned."""
    ds = cfg.sweep.downstream
    seeds = ds.seeds or [cfg.finetune.seed]
    out = []
    for g in groups:
        prefix = "" if g.name == "default" else f"{g.name}/"
        for r in g.runs:
            for task in ds.tasks:
                for seed in seeds:
                    folder = f"{DOWNSTREAM_DIR}/{prefix}{r.name}/{task_slug(task)}-seed{seed}"
                    out.append(DownstreamEntry(r.name, g.name, r.precision, r.role, task, seed, folder))
    return out


def finetune_overrides(root: Path, run: RunEntry, e: DownstreamEntry) -> list[str]:
    """What makes the sweep's finetune section this fine-tune: the checkpoint, task, seed and folder."""
    return [
        f"finetune.checkpoint={root / run.dir / 'final'}",
        f"finetune.task={e.task}",
        f"finetune.seed={e.seed}",
        f"finetune.output_dir={root / e.dir}",
    ]


# --------------------------------------------------------------------------------------------------
# running them (a step of bert-mp sweep, after the pretraining runs)
# --------------------------------------------------------------------------------------------------
def run_downstream(sweep: Any, base_file: Path) -> None:
    """Fine-tune every run's final checkpoint as ``sweep.downstream`` asks, recording each in
    ``sweep.json`` as it goes. Every fine-tune's config is validated before the first one starts."""
    cfg, root = sweep.cfg, sweep.root
    runs = {(g.name, r.name): r for g in sweep.groups for r in g.runs}
    entries = plan_downstream(sweep.groups, cfg)
    configs = [load_config(base_file, finetune_overrides(root, runs[(e.group, e.run)], e)) for e in entries]
    _check_glue_copy(cfg)
    sweep.downstream = entries
    sweep.write_manifest()
    for i, (e, ft_cfg) in enumerate(zip(entries, configs), 1):
        label = f"downstream [{i}/{len(entries)}] {e.run} {e.task} seed {e.seed}"
        run = runs[(e.group, e.run)]
        checkpoint = root / run.dir / "final"
        if run.status != "completed" or not (checkpoint / "config.json").is_file():
            e.status = "skipped"
            e.reason = f"pretraining run {run.name} is {run.status}: no final checkpoint to fine-tune"
            print(f"bert-mp sweep: {label}: skipped ({e.reason})", flush=True)
            continue
        folder = root / e.dir
        action, why = folder_action(ft_cfg, keep=FINAL_STATUSES, source=checkpoint)
        if action == "keep":
            record_outcome(e, FinetuneSummary.load(folder), None)
            print(f"bert-mp sweep: {label}: {why}, kept", flush=True)
            continue
        if why:
            print(f"bert-mp sweep: {label}: {why}", flush=True)
        ovs = [*finetune_overrides(root, run, e), *RESUME.get(action, [])]
        e.resumed = action == "resume"
        print(f"bert-mp sweep: {label}: {'resuming' if e.resumed else 'fine-tuning'} ...", flush=True)
        e.returncode, e.wall_s, e.cpu_s, last_error = sweep.execute("finetune", ovs, folder)
        record_outcome(e, FinetuneSummary.load(folder), last_error)
        value = metric_of(e.task, FinetuneSummary.load(folder))
        shown = f": {value.name} {value.value:.4f} ({value.split})" if value.value is not None else ""
        tail = f" ({e.reason})" if e.reason else ""
        print(
            f"bert-mp sweep: {label}: {e.status} in {e.wall_s:.0f}s ({e.cpu_s:.0f} CPU s){shown}{tail}",
            flush=True,
        )
        sweep.write_manifest()


def _check_glue_copy(cfg: Config) -> None:
    """A local GLUE copy (``finetune.glue_data``) holds the GLUE tasks' files, before any fine-tune."""
    glue = [t.removeprefix("glue/") for t in cfg.sweep.downstream.tasks if t.startswith("glue/")]
    if glue and cfg.finetune.glue_data:
        from bert_mp.finetune.glue_data import check_local_copy

        check_local_copy(cfg.finetune.glue_data, glue, "finetune.glue_data")


# --------------------------------------------------------------------------------------------------
# the metric a task is judged by, and the verdict
# --------------------------------------------------------------------------------------------------
@dataclass
class Metric:
    name: str
    split: str
    value: float | None


def metric_of(task: str, summary: FinetuneSummary | None) -> Metric:
    """The figure a fine-tune is judged by: on test where the task has it, else on validation; GLUE's
    own figure for a GLUE task (:mod:`bert_mp.finetune.glue`), macro-F1 otherwise."""
    name = "macro_f1"
    if task.startswith("glue/"):
        from bert_mp.finetune.glue_data import glue_task

        name = glue_task(task).score
    if summary is None or summary.status != "completed":
        return Metric(name, "-", None)
    split, m = ("test", summary.test) if summary.test else ("validation", summary.validation)
    if not m:
        return Metric(name, split, None)
    if task.startswith("glue/"):
        from bert_mp.finetune.glue import split_metrics
        from bert_mp.finetune.glue_data import glue_task

        return Metric(name, split, split_metrics(glue_task(task), m, (summary.task or {})["labels"])[name])
    return Metric(name, split, m.get(name))


@dataclass
class Cell:
    """One run's fine-tunes of one task: the pretraining run and each fine-tune's status and figure."""

    run: str
    precision: str
    role: str
    run_status: str
    run_reason: str | None
    seeds: list[int] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)
    values: list[float | None] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)

    @property
    def done(self) -> list[float]:
        return [v for s, v in zip(self.statuses, self.values) if s == "completed" and v is not None]

    @property
    def complete(self) -> bool:
        return bool(self.statuses) and all(s == "completed" for s in self.statuses)

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.done) if self.done else None


def band(cells: list[Cell]) -> tuple[dict[str, Any], str | None]:
    """The fp32 band (its values, the reference mean, its relative width), or why it is not measurable."""
    ref = next((c for c in cells if c.role == "reference"), None)
    spread = next((c for c in cells if c.role == "seed_spread"), None)
    out: dict[str, Any] = {"values": [], "min": None, "max": None, "reference_mean": None, "rel_width": None}
    if ref is None or not ref.complete or ref.mean is None:
        why = (
            "no fp32 reference run"
            if ref is None
            else f"the fp32 reference's fine-tunes did not all complete ({_count(ref)})"
        )
        return out, why
    out["reference_mean"] = ref.mean
    if spread is None or not spread.complete or not spread.done:
        what = (
            "no second fp32 seed"
            if spread is None
            else f"the second fp32 seed's fine-tunes did not all complete ({_count(spread)})"
        )
        return out, f"the fp32 band is not measurable: {what}"
    values = ref.done + spread.done
    out.update(values=values, min=min(values), max=max(values))
    if ref.mean == 0:
        return out, "the fp32 reference's mean is 0: a band relative to it is not defined"
    out["rel_width"] = (max(values) - min(values)) / abs(ref.mean)
    return out, None


def _count(c: Cell) -> str:
    return f"{sum(s == 'completed' for s in c.statuses)} of {len(c.statuses)}"


def judge(
    cell: Cell, fp32: dict[str, Any], withheld: str | None, rules: parity.VerdictRules, name: str
) -> dict:
    """One run's downstream verdict: reference / seed spread / skipped / incomplete / n/a (withheld,
    with the reason) / pass / warn / fail, by the loss verdict's rule."""
    if cell.role == "reference":
        if cell.complete:
            return _verdict("reference", "the fp32 reference")
        return _verdict("n/a", withheld or f"fine-tunes unfinished ({_count(cell)})")
    if cell.run_status == "skipped":
        return _verdict("skipped", cell.run_reason or "skipped")
    if cell.run_status in ("stopped", "pending", "running"):
        return _verdict("incomplete", f"pretraining run is {cell.run_status}: run `bert-mp sweep` again")
    if cell.run_status != "completed":
        return _verdict("fail", f"pretraining run is {cell.run_status}: no checkpoint to fine-tune")
    ref = fp32["reference_mean"]
    deviation = abs(cell.mean - ref) / abs(ref) if ref and cell.mean is not None else None
    if cell.role == "seed_spread":
        why = withheld or "fp32 with another seed: spans the band with the reference"
        return _verdict("seed spread", why, {"value": deviation} if deviation is not None else None)
    failed = [
        f"seed {s}: {r or st}"
        for s, st, r in zip(cell.seeds, cell.statuses, cell.reasons)
        if st not in ("completed", "pending", "stopped")
    ]
    if failed:
        return _verdict("fail", f"fine-tune failed ({'; '.join(failed)})")
    if not cell.complete:
        return _verdict("incomplete", f"fine-tunes unfinished ({_count(cell)}): run `bert-mp sweep` again")
    if withheld:
        return _verdict("n/a", withheld, {"value": deviation})
    reasons: list[str] = []
    check = parity.check_deviation(name, deviation, fp32["rel_width"], rules, reasons)
    return {"status": check["status"], "reasons": reasons, "check": check}


def _verdict(status: str, reason: str, check: dict | None = None) -> dict[str, Any]:
    return {"status": status, "reasons": [reason], "check": check}


def task_verdicts(cells: list[Cell], rules: parity.VerdictRules, name: str) -> dict[str, Any]:
    """Every run's verdict on one task of one group, with the fp32 band they are judged against."""
    fp32, withheld = band(cells)
    runs = {}
    for c in cells:
        runs[c.run] = {
            "precision": c.precision,
            "role": c.role,
            "seeds": c.seeds,
            "values": c.values,
            "mean": c.mean,
            "verdict": judge(c, fp32, withheld, rules, name),
        }
    return {"band": {**fp32, "withheld": withheld}, "runs": runs}
