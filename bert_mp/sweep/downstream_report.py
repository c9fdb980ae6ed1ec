"""The report's downstream part: per group and task, each run's fine-tuned metric per seed, its mean,
the verdict against the fp32 band (:mod:`bert_mp.sweep.downstream`), a plot, summary.json's block
and the terminal's lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bert_mp.sweep import parity
from bert_mp.sweep.document import Block, Image, Table, fmt, pct
from bert_mp.sweep.downstream import Cell, metric_of, task_slug, task_verdicts
from bert_mp.sweep.record import FinetuneSummary, SweepRecord
from bert_mp.sweep.results import GroupResult

RECIPE_KEYS = (
    "precision",
    "learning_rate",
    "batch_size",
    "epochs",
    "max_steps",
    "max_seq_length",
    "warmup_ratio",
    "select_best",
)
"""The finetune keys the report states as the one recipe every precision's checkpoint got."""


def analyse(
    root: Path, record: SweepRecord, groups: list[GroupResult], rules: parity.VerdictRules
) -> dict[str, Any] | None:
    """summary.json's ``downstream`` block: the recipe, then per group and task the metric, the fp32
    band and each run's values, mean and verdict (None: the sweep had no downstream step)."""
    ds = record.config["sweep"].get("downstream") or {}
    if not ds.get("tasks"):
        return None
    ft = record.config["finetune"]
    out: dict[str, Any] = {
        "tasks": ds["tasks"],
        "seeds": ds["seeds"] or [ft["seed"]],
        "recipe": {k: ft.get(k) for k in RECIPE_KEYS},
        "groups": [],
    }
    for g in groups:
        tasks = {}
        for task in ds["tasks"]:
            cells, metric = _cells(root, record, g, task)
            name = f"{task}:{metric[0]}"
            tasks[task] = {"metric": metric[0], "split": metric[1], **task_verdicts(cells, rules, name)}
        out["groups"].append({"name": g.name, "tasks": tasks})
    return out


def _cells(
    root: Path, record: SweepRecord, group: GroupResult, task: str
) -> tuple[list[Cell], tuple[str, str]]:
    """Each run's :class:`Cell` for one task, and the (metric, split) the figures are."""
    entries = [e for e in record.downstream if e.group == group.name and e.task == task]
    cells, metric = [], (metric_of(task, None).name, "-")
    for run in group.runs:
        cell = Cell(run.name, run.precision, run.role, run.status, run.problem)
        for e in (e for e in entries if e.run == run.name):
            summary = FinetuneSummary.load(root / e.dir)
            m = metric_of(task, summary)
            if m.value is not None:
                metric = (m.name, m.split)
            status = summary.status if summary else e.status
            if status == "completed" and e.status == "failed":  # exited non-zero after its summary
                status = "failed"
            if summary is None and e.status == "completed":
                status, e.reason = "missing", "its summary.json is gone"
            cell.seeds.append(e.seed)
            cell.statuses.append(status)
            cell.values.append(m.value)
            cell.reasons.append(e.reason or (summary.error if summary else None))
        cells.append(cell)
    return cells, metric


# --------------------------------------------------------------------------------------------------
# report.md / report.html
# --------------------------------------------------------------------------------------------------
HEADERS = ["run", "precision", "per seed", "mean", "dev from fp32 (x tol)", "verdict", "why"]
SKIPPED = "its pretraining run was skipped (see Skipped and unfinished runs)"


def sections(
    data: dict[str, Any] | None, root: Path, rules: parity.VerdictRules
) -> list[tuple[str, list[Block]]]:
    """The Downstream section: the recipe, the rule, then per group and task the band, table and plot."""
    if data is None:
        return []
    r = data["recipe"]
    budget = f"{r['max_steps']} steps" if r.get("max_steps") else f"{r['epochs']} epochs"
    blocks: list[Block] = [
        f"Every run's final checkpoint fine-tuned on {', '.join(f'`{t}`' for t in data['tasks'])} with seeds "
        f"{', '.join(map(str, data['seeds']))}, one recipe for every precision: fine-tuning precision "
        f"**{r['precision']}**, lr {r['learning_rate']}, batch {r['batch_size']}, {budget}, "
        f"{r['max_seq_length']} tokens, warm-up {r['warmup_ratio']}, "
        f"{'best validation epoch' if r['select_best'] else 'last weights'} (the sweep's finetune section).",
        "Verdict (the loss verdict's rule): per task the mean over seeds is compared with the fp32 reference "
        "run's mean; its relative deviation is divided by the tolerance max(fp32 band, "
        f"{rules.min_spread:g}), where the band is the spread (max - min, relative to the reference mean) of "
        f"all fine-tunes of both fp32 pretraining seeds. PASS <= {rules.warn_multiplier:g}x, WARN <= "
        f"{rules.fail_multiplier:g}x, FAIL above or when a fine-tune failed; n/a, with the reason, where the "
        "band cannot be measured.",
    ]
    several = len(data["groups"]) > 1
    for g in data["groups"]:
        for task, t in g["tasks"].items():
            head = f"**{task}**" + (f" ({g['name']})" if several else "")
            blocks.append(f"{head}: {t['metric']} on {t['split']}. {_band_line(t['band'])}")
            blocks.append(Table(HEADERS, [_row(name, v) for name, v in t["runs"].items()]))
            plot = plot_task(g["name"], task, t, root / "plots")
            if plot is not None:
                blocks.append(Image(f"{task}: {t['metric']} per seed and mean, fp32 band shaded", plot))
    return [("Downstream (fine-tuned checkpoints)", blocks)]


def _band_line(b: dict[str, Any]) -> str:
    if b["min"] is None:
        return f"fp32 band: not measurable ({b['withheld']})."
    width = pct(b["rel_width"]) if b["rel_width"] is not None else "-"
    return (
        f"fp32 band: {fmt(b['min'], '.4f')} .. {fmt(b['max'], '.4f')} over {len(b['values'])} fine-tunes "
        f"(reference mean {fmt(b['reference_mean'], '.4f')}, width {width})."
    )


def _row(name: str, v: dict[str, Any]) -> list[str]:
    verdict, check = v["verdict"], v["verdict"]["check"] or {}
    per_seed = ", ".join(f"{s}: {fmt(x, '.4f')}" for s, x in zip(v["seeds"], v["values"])) or "-"
    dev = "-"
    if check.get("value") is not None:
        dev = pct(check["value"]) + (
            f" ({fmt(check['ratio'], '.1f')}x)" if check.get("ratio") is not None else ""
        )
    status = verdict["status"].upper() if verdict["status"] in parity.VERDICTS else verdict["status"]
    why = "; ".join(r for r in verdict["reasons"] if r)
    if status == "skipped":  # the pretraining run's reason, given once in the report
        why = SKIPPED
    return [name, v["precision"], per_seed, fmt(v["mean"], ".4f"), dev, status, why]


def plot_task(group: str, task: str, t: dict[str, Any], plots_dir: Path) -> Path | None:
    """Each run's figures per seed (dots) and mean (bar), the fp32 band shaded; None without figures."""
    runs = [(n, v) for n, v in t["runs"].items() if any(x is not None for x in v["values"])]
    if not runs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bert_mp.sweep.plots import COLORS

    plots_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(runs), 3.6))
    b = t["band"]
    if b["min"] is not None:
        ax.axhspan(b["min"], b["max"], color="grey", alpha=0.3, label="fp32 band")
    for i, (_, v) in enumerate(runs):
        color = COLORS.get(v["precision"], "tab:green")
        xs = [x for x in v["values"] if x is not None]
        ax.scatter([i] * len(xs), xs, color=color, s=18, zorder=3)
        if v["mean"] is not None:
            ax.hlines(v["mean"], i - 0.3, i + 0.3, color=color, lw=2, zorder=3)
    ax.set_xticks(range(len(runs)), [n for n, _ in runs], rotation=20, fontsize=8)
    ax.set_ylabel(f"{t['metric']} ({t['split']})")
    ax.set_title(f"{task} fine-tuned from each run ({group})", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    if b["min"] is not None:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = plots_dir / f"{group}_downstream_{task_slug(task)}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def lines(summary: dict[str, Any]) -> list[str]:
    """The terminal's downstream verdicts, one line per run and task."""
    data = summary.get("downstream")
    if not data:
        return []
    out = []
    several = len(data["groups"]) > 1
    for g in data["groups"]:
        for task, t in g["tasks"].items():
            prefix = f"{g['name']}/" if several else ""
            for name, v in t["runs"].items():
                status = v["verdict"]["status"]
                shown = status.upper() if status in parity.VERDICTS else status
                why = "; ".join(r for r in v["verdict"]["reasons"] if r)
                if status == "skipped":  # the loss verdict's line above gave the reason
                    why = "its pretraining run was skipped (the reason is above)"
                mean = f"{t['metric']} {fmt(v['mean'], '.4f')}"
                out.append(f"  downstream {task:<16} {prefix + name:<18} {shown:<12} {mean:<18} {why}")
    return out
