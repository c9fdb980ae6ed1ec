"""``bert-mp report <sweep dir>``: verdicts, speed ladder, memory, kernel check and plots of a sweep.

Reads the sweep manifest (``sweep.json``, written by ``bert_mp.sweep.runner``), every run folder
(``summary.json`` + ``metrics.jsonl``, see docs/architecture.md) and the diagnostics probes, and
writes ``report.md``, a self-contained ``report.html`` (plots embedded as base64 PNG),
``summary.json`` and ``plots/*.png``. Verdicts are recomputed from the run data every time, so a
report can be rewritten with other multipliers without training again.
"""

from __future__ import annotations

import base64
import html
import json
import math
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path
from typing import Any

from bert_mp.core.config import SweepConfig
from bert_mp.core.io import atomic_write_json, atomic_write_text, read_jsonl
from bert_mp.sweep import diagnostics, fairness, grid, parity
from bert_mp.sweep.record import RunEntry, RunSummary, SweepRecord, strict_record


# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One run of the sweep record with what its folder holds."""

    entry: RunEntry
    summary: RunSummary | None
    rows: list[dict[str, Any]]

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def precision(self) -> str:
        return self.entry.precision

    @property
    def role(self) -> str:
        return self.entry.role

    @property
    def status(self) -> str:
        return self.summary.status if self.summary is not None else self.entry.status

    @cached_property
    def curves(self) -> parity.Curves:
        return parity.curves_from_rows(self.rows)

    @cached_property
    def fp16_health(self) -> dict[str, Any] | None:
        """Loss-scale trajectory and skips (None without a scaler), computed once per run."""
        return diagnostics.loss_scale_health(self.rows)

    @property
    def problem(self) -> str | None:
        """Why the run did not complete: its error, or the sweep's reason (a skip)."""
        return (self.summary.error if self.summary else None) or self.entry.reason


@dataclass
class GroupResult:
    """Runs that share every axis but precision; compared against their own fp32 reference."""

    name: str
    axes: dict[str, Any]
    runs: list[Run] = field(default_factory=list)

    def by_role(self, role: str) -> Run | None:
        return next((r for r in self.runs if r.role == role), None)


def load_sweep(sweep_dir: str | Path) -> tuple[SweepRecord, list[GroupResult]]:
    """The sweep record and the runs of a sweep folder, grouped."""
    root = Path(sweep_dir)
    record = SweepRecord.load(root)
    groups = {g.name: GroupResult(g.name, g.axes) for g in record.groups}
    for entry in record.runs:
        run_dir = root / entry.dir
        rows = list(read_jsonl(run_dir / "metrics.jsonl")) if (run_dir / "metrics.jsonl").is_file() else []
        groups.setdefault(entry.group, GroupResult(entry.group, {})).runs.append(
            Run(entry, RunSummary.load(run_dir), rows)
        )
    return record, list(groups.values())


# --------------------------------------------------------------------------------------------------
# analysis
# --------------------------------------------------------------------------------------------------
def verdict_rules(record: SweepRecord) -> parity.VerdictRules:
    """The verdict rules of the sweep's own config (``sweep.json`` holds the resolved tree)."""
    return parity.VerdictRules.from_sweep(
        strict_record(SweepConfig, record.config["sweep"], "sweep.json: config.sweep", require_all=True)
    )


def group_verdicts(group: GroupResult, rules: parity.VerdictRules) -> dict[str, dict[str, Any]]:
    """Verdict per run of a group: reference, seed spread, skipped, n/a or pass / warn / fail."""
    ref = group.by_role("reference")
    spread = group.by_role("seed_spread")
    ref_ok = ref is not None and ref.status == "completed" and ref.rows
    spread_curves = (
        spread.curves if spread is not None and spread.status == "completed" and spread.rows else None
    )
    out: dict[str, dict[str, Any]] = {}
    for run in group.runs:
        if run.status == "skipped":
            out[run.name] = {"status": "skipped", "reasons": [run.entry.reason or "skipped"]}
        elif run.role == "reference":
            reasons = ["the fp32 reference"] if ref_ok else [f"reference run is {run.status}: no verdicts"]
            out[run.name] = {"status": "reference" if ref_ok else "n/a", "reasons": reasons}
        elif not ref_ok:
            out[run.name] = {"status": "n/a", "reasons": ["no completed fp32 reference in this group"]}
        elif not run.rows:
            out[run.name] = {
                "status": "fail",
                "reasons": [f"run is {run.status} with no metrics" + _error_suffix(run)],
            }
        else:
            out[run.name] = _judge(run, ref, spread_curves, rules)
    return out


def _judge(run: Run, ref: Run, spread_curves: Any, rules: parity.VerdictRules) -> dict[str, Any]:
    unfinished = run.status in ("stopped", "pending", "running")
    # an interrupted run is judged on the steps it has: a failure already visible stands,
    # anything else waits for the sweep to be resumed
    status = "completed" if unfinished else run.status
    d = parity.verdict(run.curves, ref.curves, spread_curves, rules, run_status=status).to_dict()
    if unfinished and d["status"] != "fail":
        d["status"] = "incomplete"
        d["reasons"] = [f"run is {run.status}: run `bert-mp sweep` again to resume it"]
    if run.role == "seed_spread":
        d["status"] = "seed spread"
        d["reasons"] = ["fp32 with another seed: defines the tolerance"]
    elif run.status != "completed":
        d["reasons"].append(_error_suffix(run).strip(": ") or "")
    return d


def _error_suffix(run: Run) -> str:
    err = run.problem
    return f": {err}" if err else ""


def _fmt(x: Any, spec: str = ".4g", none: str = "-") -> str:
    if x is None:
        return none
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, spec)


def _pct(x: Any) -> str:
    return _fmt(x * 100 if isinstance(x, (int, float)) else None, ".3g") + ("%" if x is not None else "")


def _cost(entry: RunEntry | None) -> str:
    if entry is None or entry.wall_s is None:
        return "-"
    return f"{entry.wall_s:.0f} / {_fmt(entry.cpu_s, '.0f')}"


def _bytes(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x / 2**20:.1f} MiB"


# --------------------------------------------------------------------------------------------------
# plots
# --------------------------------------------------------------------------------------------------
COLORS = {"fp32": "black", "tf32": "tab:purple", "bf16": "tab:blue", "fp16": "tab:orange"}


def _plot_group(group: GroupResult, rules: parity.VerdictRules, plots_dir: Path) -> list[tuple[str, Path]]:
    """Every plot of one group, as (caption, path); plots without data are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots_dir.mkdir(parents=True, exist_ok=True)
    made: list[tuple[str, Path]] = []
    for plot in (_plot_losses, _plot_deviation, _plot_throughput, _plot_memory, _plot_loss_scale):
        made += plot(plt, group, rules, plots_dir)
    return made


def _smoothed(run: Run, key: str, window: int) -> tuple[list[int], list[float]]:
    pts = run.curves.series("train", key)
    return [s for s, _ in pts], parity.moving_average([v for _, v in pts], window)


def _seed_band(ax: Any, group: GroupResult, key: str, window: int) -> None:
    ref, spread = group.by_role("reference"), group.by_role("seed_spread")
    if ref is None or spread is None or not ref.rows or not spread.rows:
        return
    s1, v1 = _smoothed(ref, key, window)
    s2, v2 = _smoothed(spread, key, window)
    common = sorted(set(s1) & set(s2))
    a, b = dict(zip(s1, v1)), dict(zip(s2, v2))
    lo, hi = [min(a[s], b[s]) for s in common], [max(a[s], b[s]) for s in common]
    ax.fill_between(common, lo, hi, color="grey", alpha=0.3, label="fp32 seed band")


def _plot_losses(plt: Any, group: GroupResult, rules: parity.VerdictRules, plots_dir: Path) -> list:
    with_data = [r for r in group.runs if r.rows]
    if not with_data:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key in zip(axes, ("loss/mlm", "loss/nsp")):
        _seed_band(ax, group, key, rules.window)
        for run in with_data:
            if run.role != "seed_spread":
                s, v = _smoothed(run, key, rules.window)
                ax.plot(s, v, color=COLORS.get(run.precision), label=run.name, lw=1.2)
        ax.set_xlabel("step")
        ax.set_ylabel(f"{key} (moving average, {rules.window} steps)")
        ax.set_yscale("log" if key == "loss/mlm" else "linear")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Training loss by precision ({group.name})")
    return [
        (
            "Loss curves (fp32 seed band shaded)",
            _finish(plt, fig, plots_dir / f"{group.name}_loss_curves.png"),
        )
    ]


def _plot_deviation(plt: Any, group: GroupResult, rules: parity.VerdictRules, plots_dir: Path) -> list:
    ref = group.by_role("reference")
    if ref is None or not ref.rows:
        return []
    fig, ax = plt.subplots(figsize=(8, 4))
    ref_mlm = ref.curves.series("train", "loss/mlm")
    for run in group.runs:
        if run.rows and run.role != "reference":
            d = parity.deviation(run.curves.series("train", "loss/mlm"), ref_mlm, rules.window)
            style = "--" if run.role == "seed_spread" else "-"
            color = COLORS.get(run.precision, "grey")
            ax.plot(d.steps, [100 * x for x in d.rel], style, color=color, label=run.name)
    ax.axhline(0, color="black", lw=0.8)
    title = f"Deviation from the fp32 reference ({group.name}); dashed: another fp32 seed"
    _label_steps(ax, "MLM loss deviation from fp32 (%)", title)
    return [("Deviation from fp32", _finish(plt, fig, plots_dir / f"{group.name}_deviation.png"))]


def _measured(group: GroupResult) -> list[tuple[str, str, RunSummary]]:
    return [(r.name, r.precision, r.summary) for r in group.runs if r.summary and r.role != "seed_spread"]


def _plot_throughput(plt: Any, group: GroupResult, rules: parity.VerdictRules, plots_dir: Path) -> list:
    tps = [(n, p, (s.throughput or {}).get("tokens_per_sec")) for n, p, s in _measured(group)]
    tps = [t for t in tps if t[2]]
    if not tps:
        return []
    path = plots_dir / f"{group.name}_tokens_per_sec.png"
    return [("Throughput", _bar(plt, tps, "tokens / s (non-padding)", f"Throughput ({group.name})", path))]


def _plot_memory(plt: Any, group: GroupResult, rules: parity.VerdictRules, plots_dir: Path) -> list:
    bars = _measured(group)
    mem = [(n, p, ((s.memory or {}).get("peak_bytes") or 0) / 2**20) for n, p, s in bars]
    mem = [m for m in mem if m[2]]
    if not mem:
        return []
    kind = (bars[0][2].memory or {}).get("kind") or "peak"
    path = plots_dir / f"{group.name}_peak_memory.png"
    return [("Peak memory", _bar(plt, mem, f"MiB ({kind})", f"Peak memory ({group.name})", path))]


def _plot_loss_scale(plt: Any, group: GroupResult, rules: parity.VerdictRules, plots_dir: Path) -> list:
    scaled = [(r, r.fp16_health) for r in group.runs if r.fp16_health]
    if not scaled:
        return []
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for run, h in scaled:
        steps, scales = zip(*h["trajectory"])
        label = f"{run.name} ({h['skipped_steps']} skipped)"
        ax.step(steps, scales, where="post", color=COLORS.get(run.precision), label=label)
    ax.set_yscale("log", base=2)
    _label_steps(ax, "loss scale", f"fp16 dynamic loss scale ({group.name})")
    return [("fp16 loss scale", _finish(plt, fig, plots_dir / f"{group.name}_loss_scale.png"))]


def _label_steps(ax: Any, ylabel: str, title: str) -> None:
    """Axes over training steps: labels, title, grid and legend."""
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _finish(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def _bar(plt: Any, items: list[tuple[str, str, float]], ylabel: str, title: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [n for n, _, _ in items]
    vals = [v for _, _, v in items]
    ax.bar(names, vals, color=[COLORS.get(p, "grey") for _, p, _ in items])
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=100)
    return path


# --------------------------------------------------------------------------------------------------
# document model: rendered to markdown and to HTML from the same content
# --------------------------------------------------------------------------------------------------
@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]


@dataclass
class Image:
    caption: str
    path: Path


Block = str | Table | Image


def _md(sections: list[tuple[str, list[Block]]], root: Path, title: str) -> str:
    out = [f"# {title}", ""]
    for heading, blocks in sections:
        out += [f"## {heading}", ""]
        for b in blocks:
            if isinstance(b, Table):
                out.append("| " + " | ".join(b.headers) + " |")
                out.append("| " + " | ".join("---" for _ in b.headers) + " |")
                out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in b.rows]
            elif isinstance(b, Image):
                out.append(f"![{b.caption}]({b.path.relative_to(root).as_posix()})")
            elif b:
                out.append(b)
            else:
                continue
            out.append("")
    return "\n".join(out)


def _html(sections: list[tuple[str, list[Block]]], title: str) -> str:
    e = html.escape
    body = [f"<h1>{e(title)}</h1>"]
    for heading, blocks in sections:
        body.append(f"<h2>{e(heading)}</h2>")
        for b in blocks:
            if isinstance(b, Table):
                head = "".join(f"<th>{e(h)}</th>" for h in b.headers)
                rows = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in b.rows)
                body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
            elif isinstance(b, Image):
                data = base64.b64encode(b.path.read_bytes()).decode("ascii")
                body.append(
                    f'<figure><img alt="{e(b.caption)}" src="data:image/png;base64,{data}">'
                    f"<figcaption>{e(b.caption)}</figcaption></figure>"
                )
            elif b:
                body.append(f"<p>{e(b).replace('`', '').replace('**', '')}</p>")
    style = (
        "body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}"
        "table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:13px}"
        "th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}"
        "th{background:#f3f3f3}img{max-width:100%}figure{margin:1em 0}"
    )
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>'
        f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


# --------------------------------------------------------------------------------------------------
# the report: a list of section functions over one analysis per group
# --------------------------------------------------------------------------------------------------
Section = tuple[str, list[Block]]


@dataclass
class GroupAnalysis:
    """What the sections of one group show, computed once."""

    group: GroupResult
    label: str
    """`` (<group>)`` when the sweep has several groups, else empty."""
    verdicts: dict[str, dict[str, Any]]
    ladder: list[dict[str, Any]]
    probes: dict[str, dict[str, Any] | None]
    plots: list[tuple[str, Path]]


@dataclass
class Report:
    """A sweep folder being reported on."""

    root: Path
    record: SweepRecord
    groups: list[GroupResult]
    rules: parity.VerdictRules

    @cached_property
    def first_summary(self) -> RunSummary | None:
        return next((r.summary for g in self.groups for r in g.runs if r.summary), None)

    @property
    def versions(self) -> dict[str, str]:
        s = self.first_summary
        return (s.versions or s.precision.get("versions") or {}) if s else {}

    def analyse(self, group: GroupResult) -> GroupAnalysis:
        with_summary = [
            {"name": r.name, "precision": r.precision, "summary": r.summary.raw}
            for r in group.runs
            if r.summary and r.role != "seed_spread"
        ]
        ref = group.by_role("reference")
        probes = {r.precision: self.probe(group, r.precision) for r in group.runs if r.role != "seed_spread"}
        return GroupAnalysis(
            group=group,
            label=f" ({group.name})" if len(self.groups) > 1 else "",
            verdicts=group_verdicts(group, self.rules),
            ladder=fairness.withhold_speedups(
                diagnostics.speed_ladder(with_summary, reference=ref.name if ref else "fp32"),
                unequal_conditions(group),
            ),
            probes=probes,
            plots=_plot_group(group, self.rules, self.root / "plots"),
        )

    def probe(self, group: GroupResult, precision: str) -> dict[str, Any] | None:
        p = self.root / "diagnostics" / group.name / f"{precision}.json"
        return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else None


def overview_section(rep: Report) -> list[Section]:
    s, rec, rules = rep.first_summary, rep.record, rep.rules
    prec0 = s.precision if s else {}
    tcfg, dcfg, mcfg = rec.config["train"], rec.config["data"], rec.config["model"]
    capability = f", compute capability {prec0['cuda_capability']}" if prec0.get("cuda_capability") else ""
    return [
        (
            "Overview",
            [
                f"Sweep folder `{rep.root}`; report written {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}.",
                f"Device: **{prec0.get('device_name', 'unknown')}** ({prec0.get('device', '?')}{capability}). "
                f"Host: {rec.host.description}.",
                "Versions: " + (", ".join(f"{k} {v}" for k, v in rep.versions.items()) or "n/a") + ".",
                f"Base recipe: `{rec.base or 'defaults'}`; model preset {mcfg['preset']}, "
                f"seq length {dcfg['max_seq_length']}, global batch {tcfg['global_batch_size']}, "
                f"micro batch {tcfg['micro_batch_size']}, {tcfg['max_steps']} steps, lr {tcfg['learning_rate']}, "
                f"seed {tcfg['seed']}; launcher `{rec.launcher}`.",
                f"Verdict rules: losses smoothed over {rules.window} steps; per check, deviation / tolerance where "
                f"tolerance = max(fp32 seed-to-seed spread, {rules.min_spread:g}); PASS <= {rules.warn_multiplier:g}x, "
                f"WARN <= {rules.fail_multiplier:g}x, FAIL above; hard FAIL on NaN/inf, an incomplete run, or a "
                f"smoothed MLM loss more than {rules.divergence_rel:.0%} from fp32 at any step. Train checks use the "
                "mean deviation over all steps, eval checks the final evaluation.",
                *(
                    [
                        "Objective `mlm`: packed sequences without NSP labels; NSP is not used (no NSP loss is "
                        "trained), so the NSP checks and columns are n/a."
                    ]
                    if dcfg.get("objective") == "mlm"
                    else []
                ),
            ],
        )
    ]


def _check_cell(checks: dict[str, Any], name: str) -> str:
    c = checks.get(name)
    if not c or c["value"] is None:
        return "-"
    if not math.isfinite(c["value"]):
        return "non-finite"
    return f"{_pct(c['value'])} ({_fmt(c['ratio'], '.1f')}x)"


def _final_eval(run: Run | None) -> dict[str, Any]:
    return (run.summary.final_eval or {}) if run and run.summary else {}


def _status_label(status: str) -> str:
    return status.upper() if status in parity.VERDICTS else status


VERDICT_HEADERS = [
    "run",
    "precision",
    "verdict",
    "train MLM dev (x tol)",
    "train NSP dev (x tol)",
    "eval MLM dev (x tol)",
    "eval NSP dev (x tol)",
    "final eval MLM loss",
    "d MLM acc",
    "d NSP acc",
    "why",
]


def verdict_section(rep: Report, ga: GroupAnalysis) -> list[Section]:
    ref_eval = _final_eval(ga.group.by_role("reference"))
    rows = []
    for run in ga.group.runs:
        v = ga.verdicts[run.name]
        checks, ev = v.get("checks") or {}, _final_eval(run)
        d_acc = [
            _fmt(ev[k] - ref_eval[k], "+.4f")
            if ev.get(k) is not None and ref_eval.get(k) is not None
            else "-"
            for k in ("eval/accuracy_mlm", "eval/accuracy_nsp")
        ]
        cells = [
            _check_cell(checks, c)
            for c in ("train:loss/mlm", "train:loss/nsp", "eval:eval/loss_mlm", "eval:eval/loss_nsp")
        ]
        why = "; ".join(r for r in v["reasons"] if r)
        rows.append(
            [
                run.name,
                run.precision,
                _status_label(v["status"]),
                *cells,
                _fmt(ev.get("eval/loss_mlm")),
                *d_acc,
                why,
            ]
        )
    axes = ", ".join(f"{k}={v}" for k, v in ga.group.axes.items())
    return [(f"Verdict{ga.label}", [f"Axes: {axes}." if axes else "", Table(VERDICT_HEADERS, rows)])]


def _speedup_cell(row: dict[str, Any]) -> str:
    if row.get("conditions_differ"):
        return "not compared (conditions differ)"
    return _fmt(row["speedup_vs_fp32"], ".2f") + ("x" if row["speedup_vs_fp32"] else "")


def unequal_conditions(group: GroupResult) -> dict[str, str]:
    """Runs of ``group`` measured under other conditions than its reference: name -> what differs."""
    ref = group.by_role("reference")
    runs = [(r.name, r.summary.conditions) for r in group.runs if r.summary and r.role != "seed_spread"]
    return fairness.unequal_runs(runs, ref.name) if ref else {}


CONDITION_HEADERS = [
    "run",
    "threads",
    "processes",
    "cores",
    "load at start -> end",
    "others' cores",
    "device",
]


def conditions_section(rep: Report, ga: GroupAnalysis) -> list[Section]:
    """What each run was measured under, and which speed-ups are withheld because that differs."""
    rows = []
    for r in ga.group.runs:
        c = r.summary.conditions if r.summary else None
        if not c:
            rows.append([r.name, "not recorded", "", "", "", "", ""])
            continue
        load = " -> ".join(f"{x[0]:.1f}" for x in (c.get("load_start"), c.get("load_end")) if x) or "n/a"
        others = c.get("others_cpu_cores")
        gpu = (c.get("gpu") or {}).get("name")
        rows.append(
            [
                r.name,
                f"{c['threads']} ({c['threads_source']})",
                str(c["processes"]),
                str(c["cores"]),
                load,
                _fmt(others, ".1f"),
                gpu or c.get("cpu_model", ""),
            ]
        )
    unequal = {r["name"]: r["conditions_differ"] for r in ga.ladder if r.get("conditions_differ")}
    blocks: list[Block] = [Table(CONDITION_HEADERS, rows)]
    if unequal:
        ref = ga.group.by_role("reference")
        names = [ref.name] if ref else []
        names += [n for n in unequal if n not in names]
        blocks.append(
            "**Not comparable: no speed-up is quoted for "
            + "; ".join(f"{n} ({why})" for n, why in unequal.items())
            + ".** Measure them again under the same conditions: "
            + fairness.rerun_hint(rep.record.sweep_file, names)
            + "."
        )
    else:
        blocks.append(
            "Every run was measured under the same threads, processes and devices, none beside other work "
            "(others' cores: CPU cores other processes used on average while the run ran)."
        )
    return [(f"Run conditions{ga.label}", blocks)]


def speed_section(rep: Report, ga: GroupAnalysis) -> list[Section]:
    entries = {r.name: r.entry for r in ga.group.runs}
    rows = [
        [
            r["name"],
            r["precision"],
            _fmt(r["step_ms"], ".1f"),
            _fmt(r["tokens_per_sec"], ".0f"),
            _speedup_cell(r),
            _pct(r["mfu"]) if r["mfu"] is not None else "n/a",
            _cost(entries.get(r["name"])),
        ]
        for r in ga.ladder
    ]
    headers = ["run", "precision", "step ms", "tokens/s", "speed-up vs fp32", "MFU", "wall s / CPU s"]
    note = (
        "Mean over the steps after the throughput monitor's warm-up; ratios compare runs of the "
        "same sweep on the same machine. MFU is n/a where the device's peak FLOP/s for the "
        "precision is unknown (e.g. CPUs). The last column is the whole run process (start-up, "
        "evaluation, checkpoints included): wall time and the CPU seconds it used, which stay "
        "meaningful when other work shares the machine."
    )
    return [(f"Speed ladder{ga.label}", [Table(headers, rows), note])]


def _memory_row(run: Run, probe: dict[str, Any] | None) -> list[str]:
    mem = (run.summary.memory if run.summary else None) or {}
    pr = probe or {}
    mb, per = pr.get("measured_bytes") or {}, pr.get("measured_bytes_per_parameter") or {}
    theory = diagnostics.bytes_per_parameter(run.precision)
    state = ("weights", "gradients", "optimizer_state")
    copies = theory["low_precision_weight_copies"]
    return [
        run.name,
        _bytes(mem.get("peak_bytes")) + (f" ({mem['kind']})" if mem.get("kind") else ""),
        " / ".join(_fmt(per.get(k), ".1f") for k in state) if per else "-",
        _fmt(theory["total"], ".0f") + f" (+{copies:.0f} transient)" * bool(copies),
        _bytes(sum(mb.get(k, 0) for k in state)) if mb else "-",
        _bytes(mb.get("activations_saved_for_backward")) if mb else "-",
    ]


MEMORY_HEADERS = [
    "run",
    "peak memory (training run)",
    "measured B/param weights / grads / AdamW",
    "B/param in theory",
    "parameter state (probe)",
    "activations saved for backward (probe)",
]
MEMORY_NOTE = (
    "Under autocast the fp32 weights stay the master copy, so parameter state is 16 B/param "
    "in every mode (4 weights + 4 gradients + 8 AdamW); bf16/fp16 only add transient 2-byte "
    "weight copies. What mixed precision saves is activation memory: the probe column sums "
    "the unique storages autograd saved for backward in one step of the sweep's model. On "
    "CPU the run's peak is the process's peak RSS (includes the Python runtime and data)."
)


def memory_section(rep: Report, ga: GroupAnalysis) -> list[Section]:
    rows = [_memory_row(r, ga.probes.get(r.precision)) for r in ga.group.runs if r.role != "seed_spread"]
    return [(f"Memory{ga.label}", [Table(MEMORY_HEADERS, rows), MEMORY_NOTE])]


def _probe_tables(pr: dict[str, Any]) -> list[Block]:
    """The kernel tables of one probe: CUDA kernels, oneDNN primitives, profiler matmul ops."""
    out: list[Block] = []
    if pr.get("cuda_kernels"):
        rows = [
            [k["kernel"][:90], k["class"], str(k["count"]), _fmt(k["device_us"], ".0f")]
            for k in pr["cuda_kernels"][:8]
        ]
        out.append(Table(["CUDA kernel", "class", "launches", "device us"], rows))
    if pr.get("onednn_matmuls"):
        rows = [
            [k["impl"], k["src_dtype"], k.get("fpmath") or "-", k["class"], str(k["count"])]
            for k in pr["onednn_matmuls"]
        ]
        out.append(Table(["oneDNN implementation", "src dtype", "fpmath", "class", "executions"], rows))
    if pr.get("matmul_ops"):
        rows = [
            [o["op"], o["input_shapes"][:70], str(o["count"]), _fmt(o["cpu_us"], ".0f")]
            for o in pr["matmul_ops"][:6]
        ]
        out.append(Table(["profiler op", "input shapes", "calls", "CPU us"], rows))
    return out


KERNEL_NOTE = (
    "How to read this: on CUDA the kernel names are matched against tensor-core patterns "
    "(xmma, hmma, wgmma, tensorop, cutlass, nvjet); on CPU oneDNN's verbose log names the "
    "implementation (`..._amx` = AMX tiles) and the data type. fp32 matmuls on CPU go to the "
    "BLAS library, which logs no kernel name, so the profile can only show they were not "
    "reduced-precision oneDNN primitives."
)


def kernel_section(rep: Report, ga: GroupAnalysis) -> list[Section]:
    blocks: list[Block] = []
    for prec, pr in ga.probes.items():
        if pr:
            blocks += [f"**{prec}**: {pr['kernel_verdict']}.", *_probe_tables(pr)]
    flags = rep.record.dimension_flags.get(ga.group.name)
    if flags is not None:
        blocks.append(
            "Dimensions not a multiple of 8 (miss tensor-core / AMX tiles): "
            + ("; ".join(flags) or "none")
            + "."
        )
    return [(f"Kernel check{ga.label}", [*blocks, KERNEL_NOTE])] if blocks else []


def fp16_section(rep: Report, ga: GroupAnalysis) -> list[Section]:
    keys = ("initial_scale", "final_scale", "min_scale")
    rows = [
        [r.name, *(_fmt(h[k], ".0f") for k in keys), str(h["scale_drops"]), str(h["skipped_steps"])]
        for r in ga.group.runs
        if (h := r.fp16_health)
    ]
    if not rows:
        return []
    headers = ["run", "initial scale", "final scale", "min scale", "scale drops", "skipped steps"]
    return [(f"fp16 health{ga.label}", [Table(headers, rows)])]


FLAG_HEADERS = [
    "run",
    "status",
    "autocast",
    "loss scaler",
    "fp32 matmul precision",
    "CUDA TF32",
    "cuDNN TF32",
    "oneDNN fp32 precision",
    "note",
]


def flags_section(rep: Report, ga: GroupAnalysis) -> list[Section]:
    rows = []
    for r in ga.group.runs:
        p = r.summary.precision if r.summary else {}
        mm = p.get("matmul") or {}
        matmul = (
            "float32_matmul_precision",
            "cuda_matmul_allow_tf32",
            "cudnn_allow_tf32",
            "mkldnn_matmul_fp32_precision",
        )
        autocast = str(p.get("autocast_dtype") or ("-" if p else ""))
        note = str(p.get("note") or r.entry.reason or "")
        rows.append(
            [
                r.name,
                r.status,
                autocast,
                str(p.get("loss_scaler", "")),
                *(str(mm.get(k, "")) for k in matmul),
                note,
            ]
        )
    return [(f"Flags that took effect{ga.label}", [Table(FLAG_HEADERS, rows)])]


def plots_section(rep: Report, ga: GroupAnalysis) -> list[Section]:
    return [(f"Plots{ga.label}", [Image(c, p) for c, p in ga.plots])] if ga.plots else []


GROUP_SECTIONS = (
    verdict_section,
    speed_section,
    conditions_section,
    memory_section,
    kernel_section,
    fp16_section,
    flags_section,
    plots_section,
)
"""Per group, in this order."""


def unfinished_section(rep: Report) -> list[Section]:
    runs = [r for g in rep.groups for r in g.runs if r.status in ("skipped", "failed", "stopped", "pending")]
    if not runs:
        return []
    rows = [[r.name, r.status, (_error_suffix(r)[2:] or "-")] for r in runs]
    return [("Skipped and unfinished runs", [Table(["run", "status", "reason"], rows)])]


def group_summary(rep: Report, ga: GroupAnalysis) -> dict[str, Any]:
    """The group's block of the report's summary.json."""
    v = ga.verdicts
    return {
        "name": ga.group.name,
        "axes": ga.group.axes,
        "verdicts": {
            n: {k: x for k, x in d.items() if k in ("status", "reasons", "checks")} for n, d in v.items()
        },
        "comparison": {n: d["comparison"] for n, d in v.items() if d.get("comparison")},
        "speed_ladder": ga.ladder,
        "memory": {r.name: r.summary.memory if r.summary else None for r in ga.group.runs},
        "probes": {
            p: {k: x for k, x in (pr or {}).items() if k in ("measured_bytes", "kernel_verdict")}
            for p, pr in ga.probes.items()
        },
        "fp16": {
            r.name: {k: x for k, x in r.fp16_health.items() if k != "trajectory"}
            for r in ga.group.runs
            if r.fp16_health
        },
        "plots": [p.relative_to(rep.root).as_posix() for _, p in ga.plots],
    }


def build_report(sweep_dir: str | Path) -> dict[str, Any]:
    """Write report.md, report.html, summary.json and plots/ into ``sweep_dir``; return the summary."""
    root = Path(sweep_dir)
    record, groups = load_sweep(root)
    rep = Report(root, record, groups, verdict_rules(record))
    analyses = [rep.analyse(g) for g in groups]
    sections = overview_section(rep)
    sections += grid.grid_section(analyses, Table, _bytes)  # precision x optimizer (sweep.optimizers)
    for ga in analyses:
        for section in GROUP_SECTIONS:
            sections += section(rep, ga)
    sections += unfinished_section(rep)
    title = "bert_mp precision sweep report"
    atomic_write_text(root / "report.md", _md(sections, root, title))
    atomic_write_text(root / "report.html", _html(sections, title))
    first = rep.first_summary
    out = {
        "sweep_dir": str(root),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": first.precision.get("device_name") if first else None,
        "versions": rep.versions,
        "rules": rep.rules.__dict__,
        "groups": [group_summary(rep, ga) for ga in analyses],
        "grid": grid.grid_summary(analyses),
        "runs": [
            {
                **asdict(r.entry),
                "status": r.status,
                "precision_flags": r.summary.precision if r.summary else None,
            }
            for g in groups
            for r in g.runs
        ],
    }
    atomic_write_json(root / "summary.json", out)
    return out


def verdict_lines(summary: dict[str, Any], skips_shown: bool = False) -> list[str]:
    """A compact verdict table for the terminal; ``skips_shown``: the reasons for skipped runs were
    printed already (by the sweep, as it skipped them), so they are not repeated."""
    lines = []
    for g in summary["groups"]:
        ladder = {r["name"]: r for r in g["speed_ladder"]}
        for name, v in g["verdicts"].items():
            sp = (ladder.get(name) or {}).get("speedup_vs_fp32")
            speed = f"{sp:.2f}x fp32 speed" if sp else ""
            if (ladder.get(name) or {}).get("conditions_differ"):
                speed = "speed not compared (run conditions differ, see the report)"
            why = "; ".join(x for x in v.get("reasons", []) if x)
            if skips_shown and v["status"] == "skipped":
                why = "(the reason is above)"
            status = v["status"].upper() if v["status"] in parity.VERDICTS else v["status"]
            prefix = f"{g['name']}/" if len(summary["groups"]) > 1 else ""
            lines.append(f"  {prefix + name:<22} {status:<12} {speed:<16} {why}")
    return lines


def command(path: str) -> int:
    """CLI entry: ``bert-mp report <sweep dir>``."""
    summary = build_report(path)
    root = Path(path)
    print(f"bert-mp report: {root / 'report.md'} ({root / 'report.html'}, {root / 'summary.json'})")
    for line in verdict_lines(summary):
        print(line)
    return 0
