"""``bert-mp report <sweep dir>``: verdicts, speed ladder, memory, kernel check and plots of a sweep.

Reads the sweep's runs and verdicts (:mod:`bert_mp.sweep.results`) and the diagnostics probes,
and writes ``report.md``, a self-contained ``report.html`` (:mod:`bert_mp.sweep.document`),
``summary.json`` and ``plots/*.png`` (:mod:`bert_mp.sweep.plots`). Verdicts are recomputed from the
run data every time, so a report can be rewritten with other multipliers without training again.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path
from typing import Any

from bert_mp.core.storage.files import atomic_write_json, atomic_write_text
from bert_mp.sweep import diagnostics, downstream_report, grid, parity, speed
from bert_mp.sweep.document import Block, Image, Table, fmt, mib, pct, to_html, to_markdown
from bert_mp.sweep.plots import plot_group
from bert_mp.sweep.record import RunSummary, SweepRecord
from bert_mp.sweep.results import GroupResult, Run, error_suffix, group_verdicts, load_sweep, verdict_rules

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
    speed_checks: list[speed.PairCheck]
    """Runs that should be equally fast, compared (:mod:`bert_mp.sweep.speed`)."""
    load_notes: list[str]
    """The load the runs met, gathered from their recorded conditions."""
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
        probes = {r.precision: self.probe(group, r.precision) for r in group.runs if r.role != "seed_spread"}
        ladder, checks = speed.checked_ladder(group, float(self.record.config["sweep"]["speed_noise"]))
        withheld = next((c.line() for c in checks if c.withholds), None)
        return GroupAnalysis(
            group=group,
            label=f" ({group.name})" if len(self.groups) > 1 else "",
            verdicts=group_verdicts(group, self.rules),
            ladder=ladder,
            speed_checks=checks,
            load_notes=speed.load_notes(group),
            probes=probes,
            plots=plot_group(group, self.rules, self.root / "plots", withheld),
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
                strategy_line(rep),
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


def strategy_line(rep: Report) -> str:
    """The distributed strategy the runs were under, as each run's summary.json records it."""
    by_label: dict[str, list[str]] = {}
    for r in (r for g in rep.groups for r in g.runs if r.summary):
        label = (r.summary.strategy or {}).get("label", "not recorded")
        by_label.setdefault(label, []).append(r.name)
    if not by_label:
        return "Distributed strategy: n/a (no run finished)."
    if len(by_label) == 1:
        return f"Distributed strategy: **{next(iter(by_label))}** (every run)."
    return (
        "Distributed strategy: " + "; ".join(f"**{k}** ({', '.join(v)})" for k, v in by_label.items()) + "."
    )


def _check_cell(checks: dict[str, Any], name: str) -> str:
    c = checks.get(name)
    if not c or c["value"] is None:
        return "-"
    if not math.isfinite(c["value"]):
        return "non-finite"
    return f"{pct(c['value'])} ({fmt(c['ratio'], '.1f')}x)"


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


SKIP_POINTER = "see Skipped and unfinished runs"
"""What a skipped run's cells say: its reason (a long one, alike for every group) is given once, there."""


def verdict_section(rep: Report, ga: GroupAnalysis) -> list[Section]:
    ref_eval = _final_eval(ga.group.by_role("reference"))
    rows = []
    for run in ga.group.runs:
        v = ga.verdicts[run.name]
        checks, ev = v.get("checks") or {}, _final_eval(run)
        d_acc = [
            fmt(ev[k] - ref_eval[k], "+.4f") if ev.get(k) is not None and ref_eval.get(k) is not None else "-"
            for k in ("eval/accuracy_mlm", "eval/accuracy_nsp")
        ]
        cells = [
            _check_cell(checks, c)
            for c in ("train:loss/mlm", "train:loss/nsp", "eval:eval/loss_mlm", "eval:eval/loss_nsp")
        ]
        why = SKIP_POINTER if v["status"] == "skipped" else "; ".join(r for r in v["reasons"] if r)
        rows.append(
            [
                run.name,
                run.precision,
                _status_label(v["status"]),
                *cells,
                fmt(ev.get("eval/loss_mlm")),
                *d_acc,
                why,
            ]
        )
    axes = ", ".join(f"{k}={v}" for k, v in ga.group.axes.items())
    return [(f"Verdict{ga.label}", [f"Axes: {axes}." if axes else "", Table(VERDICT_HEADERS, rows)])]


def _memory_row(run: Run, probe: dict[str, Any] | None) -> list[str]:
    mem = (run.summary.memory if run.summary else None) or {}
    pr = probe or {}
    mb, per = pr.get("measured_bytes") or {}, pr.get("measured_bytes_per_parameter") or {}
    theory = diagnostics.bytes_per_parameter(run.precision)
    state = ("weights", "gradients", "optimizer_state")
    copies = theory["low_precision_weight_copies"]
    return [
        run.name,
        mib(mem.get("peak_bytes")) + (f" ({mem['kind']})" if mem.get("kind") else ""),
        " / ".join(fmt(per.get(k), ".1f") for k in state) if per else "-",
        fmt(theory["total"], ".0f") + f" (+{copies:.0f} transient)" * bool(copies),
        mib(sum(mb.get(k, 0) for k in state)) if mb else "-",
        mib(mb.get("activations_saved_for_backward")) if mb else "-",
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
            [k["kernel"][:90], k["class"], str(k["count"]), fmt(k["device_us"], ".0f")]
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
            [o["op"], o["input_shapes"][:70], str(o["count"]), fmt(o["cpu_us"], ".0f")]
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
        [r.name, *(fmt(h[k], ".0f") for k in keys), str(h["scale_drops"]), str(h["skipped_steps"])]
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
        note = str(p.get("note") or (SKIP_POINTER if r.status == "skipped" else r.entry.reason) or "")
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
    speed.speed_section,
    speed.conditions_section,
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
    by_reason: dict[tuple[str, str], list[str]] = {}  # runs with the same status and reason share a row
    for r in runs:
        by_reason.setdefault((r.status, error_suffix(r)[2:] or "-"), []).append(r.name)
    rows = [[", ".join(names), status, reason] for (status, reason), names in by_reason.items()]
    return [("Skipped and unfinished runs", [Table(["runs", "status", "reason"], rows)])]


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
        "speed_checks": [c.to_dict() for c in ga.speed_checks],
        "load_notes": ga.load_notes,
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
    sections += grid.grid_section(analyses, Table, mib)  # precision x optimizer (sweep.optimizers)
    for ga in analyses:
        for section in GROUP_SECTIONS:
            sections += section(rep, ga)
    downstream = downstream_report.analyse(root, record, groups, rep.rules)  # sweep.downstream
    sections += downstream_report.sections(downstream, root, rep.rules)
    sections += unfinished_section(rep)
    title = "bert_mp precision sweep report"
    atomic_write_text(root / "report.md", to_markdown(sections, root, title))
    atomic_write_text(root / "report.html", to_html(sections, title))
    first = rep.first_summary
    out = {
        "sweep_dir": str(root),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": first.precision.get("device_name") if first else None,
        "versions": rep.versions,
        "rules": rep.rules.__dict__,
        "groups": [group_summary(rep, ga) for ga in analyses],
        "grid": grid.grid_summary(analyses),
        "downstream": downstream,
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
    said: dict[str, str] = {}  # a skip reason -> the run it was first given for
    for g in summary["groups"]:
        ladder = {r["name"]: r for r in g["speed_ladder"]}
        for name, v in g["verdicts"].items():
            row = ladder.get(name) or {}
            sp = row.get("speedup_vs_fp32")
            speed_text = f"{sp:.2f}x fp32 speed" if sp else ""
            if row.get("withheld"):
                speed_text = "speed withheld (see below)"
            elif row.get("conditions_differ"):
                speed_text = "speed not compared (run conditions differ, see the report)"
            why = "; ".join(x for x in v.get("reasons", []) if x)
            prefix = f"{g['name']}/" if len(summary["groups"]) > 1 else ""
            if skips_shown and v["status"] == "skipped":
                why = "(the reason is above)"
            elif v["status"] == "skipped" and why in said:
                why = f"(as for {said[why]})"
            elif v["status"] == "skipped":
                said[why] = prefix + name
            status = v["status"].upper() if v["status"] in parity.VERDICTS else v["status"]
            lines.append(f"  {prefix + name:<22} {status:<12} {speed_text:<16} {why}")
        group = f"{g['name']}: " if len(summary["groups"]) > 1 else ""
        lines += [f"  {group}{check_line(c)}" for c in g["speed_checks"] if not c["agree"]]
        lines += [f"  {group}load: {note}" for note in g["load_notes"]]
    return lines + downstream_report.lines(summary)


def check_line(check: dict[str, Any]) -> str:
    """A pair check of summary.json as its one line."""
    keys = [f.name for f in fields(speed.PairCheck)]
    return speed.PairCheck(**{k: check[k] for k in keys}).line()


def command(path: str) -> int:
    """CLI entry: ``bert-mp report <sweep dir>``."""
    summary = build_report(path)
    root = Path(path)
    print(f"bert-mp report: {root / 'report.md'} ({root / 'report.html'}, {root / 'summary.json'})")
    for line in verdict_lines(summary):
        print(line)
    return 0
