"""``bert-mp report <sweep dir>``: verdicts, speed ladder, memory, kernel check and plots of a sweep.

Reads the sweep manifest (``sweep.json``, written by ``bert_mp.sweep``), every run folder
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
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bert_mp import diagnostics, parity
from bert_mp.errors import ConfigError
from bert_mp.io import atomic_write_json, atomic_write_text, read_jsonl

MANIFEST = "sweep.json"


# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One entry of the manifest with what its folder holds."""

    entry: dict[str, Any]
    summary: dict[str, Any] | None
    rows: list[dict[str, Any]]

    @property
    def name(self) -> str:
        return self.entry["name"]

    @property
    def precision(self) -> str:
        return self.entry["precision"]

    @property
    def role(self) -> str:
        return self.entry.get("role", "candidate")

    @property
    def status(self) -> str:
        if self.summary is not None:
            return str(self.summary.get("status", "unknown"))
        return str(self.entry.get("status", "pending"))

    @property
    def curves(self) -> parity.Curves:
        return parity.curves_from_rows(self.rows)


@dataclass
class Group:
    """Runs that share every axis but precision; compared against their own fp32 reference."""

    name: str
    axes: dict[str, Any]
    runs: list[Run] = field(default_factory=list)

    def by_role(self, role: str) -> Run | None:
        return next((r for r in self.runs if r.role == role), None)


def load_sweep(sweep_dir: str | Path) -> tuple[dict[str, Any], list[Group]]:
    """The manifest and the runs of a sweep folder, grouped."""
    root = Path(sweep_dir)
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise ConfigError(f"{root} is not a sweep folder: {MANIFEST} is missing (run `bert-mp sweep` first)")
    manifest = json.loads(mpath.read_text(encoding="utf-8"))
    groups: dict[str, Group] = {
        g["name"]: Group(g["name"], g.get("axes", {})) for g in manifest.get("groups", [])
    }
    for entry in manifest.get("runs", []):
        run_dir = root / entry["dir"]
        summary = None
        if (run_dir / "summary.json").is_file():
            summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
        rows = list(read_jsonl(run_dir / "metrics.jsonl")) if (run_dir / "metrics.jsonl").is_file() else []
        group = groups.setdefault(entry.get("group", "default"), Group(entry.get("group", "default"), {}))
        group.runs.append(Run(entry, summary, rows))
    return manifest, list(groups.values())


# --------------------------------------------------------------------------------------------------
# analysis
# --------------------------------------------------------------------------------------------------
def rules_from_manifest(manifest: dict[str, Any]) -> parity.VerdictRules:
    sweep = manifest.get("config", {}).get("sweep", {})
    defaults = parity.VerdictRules()
    return parity.VerdictRules(
        window=int(sweep.get("parity_window", defaults.window)),
        warn_multiplier=float(sweep.get("warn_multiplier", defaults.warn_multiplier)),
        fail_multiplier=float(sweep.get("fail_multiplier", defaults.fail_multiplier)),
        min_spread=float(sweep.get("min_spread", defaults.min_spread)),
        divergence_rel=float(sweep.get("divergence_rel", defaults.divergence_rel)),
    )


def group_verdicts(group: Group, rules: parity.VerdictRules) -> dict[str, dict[str, Any]]:
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
            out[run.name] = {"status": "skipped", "reasons": [run.entry.get("reason") or "skipped"]}
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
            unfinished = run.status in ("stopped", "pending", "running")
            # an interrupted run is judged on the steps it has: a failure already visible stands,
            # anything else waits for the sweep to be resumed
            status = "completed" if unfinished else run.status
            v = parity.verdict(run.curves, ref.curves, spread_curves, rules, run_status=status)
            d = v.to_dict()
            if unfinished and d["status"] != "fail":
                d["status"] = "incomplete"
                d["reasons"] = [f"run is {run.status}: run `bert-mp sweep` again to resume it"]
            if run.role == "seed_spread":
                d["status"] = "seed spread"
                d["reasons"] = ["fp32 with another seed: defines the tolerance"]
            elif run.status != "completed":
                d["reasons"].append(_error_suffix(run).strip(": ") or "")
            out[run.name] = d
    return out


def _error_suffix(run: Run) -> str:
    err = (run.summary or {}).get("error") or run.entry.get("reason")
    return f": {err}" if err else ""


def _fmt(x: Any, spec: str = ".4g", none: str = "-") -> str:
    if x is None:
        return none
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, spec)


def _pct(x: Any) -> str:
    return _fmt(x * 100 if isinstance(x, (int, float)) else None, ".3g") + ("%" if x is not None else "")


def _cost(entry: dict[str, Any]) -> str:
    if entry.get("wall_s") is None:
        return "-"
    return f"{entry['wall_s']:.0f} / {_fmt(entry.get('cpu_s'), '.0f')}"


def _bytes(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x / 2**20:.1f} MiB"


# --------------------------------------------------------------------------------------------------
# plots
# --------------------------------------------------------------------------------------------------
COLORS = {"fp32": "black", "tf32": "tab:purple", "bf16": "tab:blue", "fp16": "tab:orange"}


def _plot_group(group: Group, rules: parity.VerdictRules, plots_dir: Path) -> list[tuple[str, Path]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots_dir.mkdir(parents=True, exist_ok=True)
    made: list[tuple[str, Path]] = []
    ref, spread = group.by_role("reference"), group.by_role("seed_spread")
    with_data = [r for r in group.runs if r.rows]
    slug = group.name

    def smoothed(run: Run, key: str) -> tuple[list[int], list[float]]:
        pts = run.curves.series("train", key)
        return [s for s, _ in pts], parity.moving_average([v for _, v in pts], rules.window)

    if with_data:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, key in zip(axes, ("loss/mlm", "loss/nsp")):
            if ref is not None and spread is not None and ref.rows and spread.rows:
                s1, v1 = smoothed(ref, key)
                s2, v2 = smoothed(spread, key)
                common = sorted(set(s1) & set(s2))
                a, b = dict(zip(s1, v1)), dict(zip(s2, v2))
                ax.fill_between(
                    common,
                    [min(a[s], b[s]) for s in common],
                    [max(a[s], b[s]) for s in common],
                    color="grey",
                    alpha=0.3,
                    label="fp32 seed band",
                )
            for run in with_data:
                if run.role == "seed_spread":
                    continue
                s, v = smoothed(run, key)
                ax.plot(s, v, color=COLORS.get(run.precision), label=run.name, lw=1.2)
            ax.set_xlabel("step")
            ax.set_ylabel(f"{key} (moving average, {rules.window} steps)")
            ax.set_yscale("log" if key == "loss/mlm" else "linear")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"Training loss by precision ({group.name})")
        fig.tight_layout()
        made.append(
            ("Loss curves (fp32 seed band shaded)", _save(fig, plots_dir / f"{slug}_loss_curves.png"))
        )
        plt.close(fig)

    if ref is not None and ref.rows:
        fig, ax = plt.subplots(figsize=(8, 4))
        for run in with_data:
            if run.role == "reference":
                continue
            d = parity.deviation(
                run.curves.series("train", "loss/mlm"), ref.curves.series("train", "loss/mlm"), rules.window
            )
            style = "--" if run.role == "seed_spread" else "-"
            ax.plot(
                d.steps,
                [100 * x for x in d.rel],
                style,
                color=COLORS.get(run.precision, "grey"),
                label=run.name,
            )
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("MLM loss deviation from fp32 (%)")
        ax.set_title(f"Deviation from the fp32 reference ({group.name}); dashed: another fp32 seed")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        made.append(("Deviation from fp32", _save(fig, plots_dir / f"{slug}_deviation.png")))
        plt.close(fig)

    bars = [(r.name, r.precision, r.summary) for r in group.runs if r.summary and r.role != "seed_spread"]
    tps = [(n, p, (s.get("throughput") or {}).get("tokens_per_sec")) for n, p, s in bars]
    tps = [t for t in tps if t[2]]
    if tps:
        made.append(
            (
                "Throughput",
                _bar(
                    plt,
                    tps,
                    "tokens / s (non-padding)",
                    f"Throughput ({group.name})",
                    plots_dir / f"{slug}_tokens_per_sec.png",
                ),
            )
        )
    mem = [(n, p, ((s.get("memory") or {}).get("peak_bytes") or 0) / 2**20) for n, p, s in bars]
    mem = [m for m in mem if m[2]]
    if mem:
        kind = ((bars[0][2].get("memory") or {}).get("kind")) or "peak"
        made.append(
            (
                "Peak memory",
                _bar(
                    plt,
                    mem,
                    f"MiB ({kind})",
                    f"Peak memory ({group.name})",
                    plots_dir / f"{slug}_peak_memory.png",
                ),
            )
        )

    scaled = [(r, diagnostics.loss_scale_health(r.rows)) for r in group.runs if r.rows]
    scaled = [(r, h) for r, h in scaled if h]
    if scaled:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        for run, h in scaled:
            steps, scales = zip(*h["trajectory"])
            ax.step(
                steps,
                scales,
                where="post",
                color=COLORS.get(run.precision),
                label=f"{run.name} ({h['skipped_steps']} skipped)",
            )
        ax.set_yscale("log", base=2)
        ax.set_xlabel("step")
        ax.set_ylabel("loss scale")
        ax.set_title(f"fp16 dynamic loss scale ({group.name})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        made.append(("fp16 loss scale", _save(fig, plots_dir / f"{slug}_loss_scale.png")))
        plt.close(fig)
    return made


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
# the report
# --------------------------------------------------------------------------------------------------
def _verdict_table(group: Group, verdicts: dict[str, dict[str, Any]]) -> Table:
    ref = group.by_role("reference")
    ref_eval = ((ref.summary or {}).get("final_eval") or {}) if ref else {}
    rows = []
    for run in group.runs:
        v = verdicts[run.name]
        checks = v.get("checks") or {}

        def cell(name: str, checks: dict = checks) -> str:
            c = checks.get(name)
            if not c or c.get("value") is None:
                return "-"
            if not math.isfinite(c["value"]):
                return "non-finite"
            return f"{_pct(c['value'])} ({_fmt(c['ratio'], '.1f')}x)"

        ev = (run.summary or {}).get("final_eval") or {}
        d_acc = [
            _fmt(ev[k] - ref_eval[k], "+.4f")
            if ev.get(k) is not None and ref_eval.get(k) is not None
            else "-"
            for k in ("eval/accuracy_mlm", "eval/accuracy_nsp")
        ]
        rows.append(
            [
                run.name,
                run.precision,
                v["status"].upper() if v["status"] in parity.VERDICTS else v["status"],
                cell("train:loss/mlm"),
                cell("train:loss/nsp"),
                cell("eval:eval/loss_mlm"),
                cell("eval:eval/loss_nsp"),
                _fmt(ev.get("eval/loss_mlm")),
                *d_acc,
                "; ".join(r for r in v.get("reasons", []) if r),
            ]
        )
    return Table(
        [
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
        ],
        rows,
    )


def _probe(root: Path, group: Group, precision: str) -> dict[str, Any] | None:
    p = root / "diagnostics" / group.name / f"{precision}.json"
    return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else None


def build_report(sweep_dir: str | Path) -> dict[str, Any]:
    """Write report.md, report.html, summary.json and plots/ into ``sweep_dir``; return the summary."""
    root = Path(sweep_dir)
    manifest, groups = load_sweep(root)
    rules = rules_from_manifest(manifest)
    sections: list[tuple[str, list[Block]]] = []
    summary_groups = []

    all_runs = [r for g in groups for r in g.runs]
    first = next((r.summary for r in all_runs if r.summary), None) or {}
    prec0 = first.get("precision") or {}
    versions = first.get("versions") or prec0.get("versions") or {}
    cfg = manifest.get("config", {})
    tcfg, dcfg, mcfg = cfg.get("train", {}), cfg.get("data", {}), cfg.get("model", {})
    overview: list[Block] = [
        f"Sweep folder `{root}`; report written {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}.",
        f"Device: **{prec0.get('device_name', 'unknown')}** ({prec0.get('device', '?')}"
        + (f", compute capability {prec0['cuda_capability']}" if prec0.get("cuda_capability") else "")
        + f"). Host: {manifest.get('host', {}).get('description', 'n/a')}.",
        "Versions: " + (", ".join(f"{k} {v}" for k, v in versions.items()) or "n/a") + ".",
        f"Base recipe: `{manifest.get('base') or 'defaults'}`; model preset {mcfg.get('preset')}, "
        f"seq length {dcfg.get('max_seq_length')}, global batch {tcfg.get('global_batch_size')}, "
        f"micro batch {tcfg.get('micro_batch_size')}, {tcfg.get('max_steps')} steps, lr {tcfg.get('learning_rate')}, "
        f"seed {tcfg.get('seed')}; launcher `{manifest.get('launcher', '?')}`.",
        f"Verdict rules: losses smoothed over {rules.window} steps; per check, deviation / tolerance where "
        f"tolerance = max(fp32 seed-to-seed spread, {rules.min_spread:g}); PASS <= {rules.warn_multiplier:g}x, "
        f"WARN <= {rules.fail_multiplier:g}x, FAIL above; hard FAIL on NaN/inf, an incomplete run, or a "
        f"smoothed MLM loss more than {rules.divergence_rel:.0%} from fp32 at any step. Train checks use the "
        "mean deviation over all steps, eval checks the final evaluation.",
    ]
    if dcfg.get("objective") == "mlm":
        overview.append(
            "Objective `mlm`: packed sequences without NSP labels; NSP is not used (no NSP loss is "
            "trained), so the NSP checks and columns are n/a."
        )
    sections.append(("Overview", overview))

    for group in groups:
        verdicts = group_verdicts(group, rules)
        label = f" ({group.name})" if len(groups) > 1 else ""
        axes = ", ".join(f"{k}={v}" for k, v in group.axes.items())
        sections.append(
            (
                f"Verdict{label}",
                [f"Axes: {axes}." if axes else "", _verdict_table(group, verdicts)],
            )
        )
        with_summary = [
            {"name": r.name, "precision": r.precision, "summary": r.summary}
            for r in group.runs
            if r.summary and r.role != "seed_spread"
        ]
        ref = group.by_role("reference")
        ladder = diagnostics.speed_ladder(with_summary, reference=ref.name if ref else "fp32")
        entries = {r.name: r.entry for r in group.runs}
        sections.append(
            (
                f"Speed ladder{label}",
                [
                    Table(
                        [
                            "run",
                            "precision",
                            "step ms",
                            "tokens/s",
                            "speed-up vs fp32",
                            "MFU",
                            "wall s / CPU s",
                        ],
                        [
                            [
                                r["name"],
                                r["precision"],
                                _fmt(r["step_ms"], ".1f"),
                                _fmt(r["tokens_per_sec"], ".0f"),
                                _fmt(r["speedup_vs_fp32"], ".2f") + ("x" if r["speedup_vs_fp32"] else ""),
                                _pct(r["mfu"]) if r["mfu"] is not None else "n/a",
                                _cost(entries.get(r["name"], {})),
                            ]
                            for r in ladder
                        ],
                    ),
                    "Mean over the steps after the throughput monitor's warm-up; ratios compare runs of the "
                    "same sweep on the same machine. MFU is n/a where the device's peak FLOP/s for the "
                    "precision is unknown (e.g. CPUs). The last column is the whole run process (start-up, "
                    "evaluation, checkpoints included): wall time and the CPU seconds it used, which stay "
                    "meaningful when other work shares the machine.",
                ],
            )
        )
        probes = {
            r.precision: _probe(root, group, r.precision) for r in group.runs if r.role != "seed_spread"
        }
        mem_rows = []
        for r in group.runs:
            if r.role == "seed_spread":
                continue
            mem = (r.summary or {}).get("memory") or {}
            pr = probes.get(r.precision) or {}
            mb = pr.get("measured_bytes") or {}
            per = pr.get("measured_bytes_per_parameter") or {}
            theory = diagnostics.bytes_per_parameter(r.precision)
            mem_rows.append(
                [
                    r.name,
                    _bytes(mem.get("peak_bytes")) + (f" ({mem['kind']})" if mem.get("kind") else ""),
                    " / ".join(_fmt(per.get(k), ".1f") for k in ("weights", "gradients", "optimizer_state"))
                    if per
                    else "-",
                    _fmt(theory["total"], ".0f")
                    + f" (+{theory['low_precision_weight_copies']:.0f} transient)"
                    * bool(theory["low_precision_weight_copies"]),
                    _bytes(sum(mb.get(k, 0) for k in ("weights", "gradients", "optimizer_state")))
                    if mb
                    else "-",
                    _bytes(mb.get("activations_saved_for_backward")) if mb else "-",
                ]
            )
        sections.append(
            (
                f"Memory{label}",
                [
                    Table(
                        [
                            "run",
                            "peak memory (training run)",
                            "measured B/param weights / grads / AdamW",
                            "B/param in theory",
                            "parameter state (probe)",
                            "activations saved for backward (probe)",
                        ],
                        mem_rows,
                    ),
                    "Under autocast the fp32 weights stay the master copy, so parameter state is 16 B/param "
                    "in every mode (4 weights + 4 gradients + 8 AdamW); bf16/fp16 only add transient 2-byte "
                    "weight copies. What mixed precision saves is activation memory: the probe column sums "
                    "the unique storages autograd saved for backward in one step of the sweep's model. On "
                    "CPU the run's peak is the process's peak RSS (includes the Python runtime and data).",
                ],
            )
        )
        kblocks: list[Block] = []
        for prec, pr in probes.items():
            if not pr:
                continue
            kblocks.append(f"**{prec}**: {pr['kernel_verdict']}.")
            if pr.get("cuda_kernels"):
                kblocks.append(
                    Table(
                        ["CUDA kernel", "class", "launches", "device us"],
                        [
                            [k["kernel"][:90], k["class"], str(k["count"]), _fmt(k["device_us"], ".0f")]
                            for k in pr["cuda_kernels"][:8]
                        ],
                    )
                )
            if pr.get("onednn_matmuls"):
                kblocks.append(
                    Table(
                        ["oneDNN implementation", "src dtype", "fpmath", "class", "executions"],
                        [
                            [k["impl"], k["src_dtype"], k.get("fpmath") or "-", k["class"], str(k["count"])]
                            for k in pr["onednn_matmuls"]
                        ],
                    )
                )
            if pr.get("matmul_ops"):
                kblocks.append(
                    Table(
                        ["profiler op", "input shapes", "calls", "CPU us"],
                        [
                            [o["op"], o["input_shapes"][:70], str(o["count"]), _fmt(o["cpu_us"], ".0f")]
                            for o in pr["matmul_ops"][:6]
                        ],
                    )
                )
        flags = manifest.get("dimension_flags", {}).get(group.name)
        if flags is not None:
            kblocks.append(
                "Dimensions not a multiple of 8 (miss tensor-core / AMX tiles): "
                + ("; ".join(flags) or "none")
                + "."
            )
        if kblocks:
            kblocks.append(
                "How to read this: on CUDA the kernel names are matched against tensor-core patterns "
                "(xmma, hmma, wgmma, tensorop, cutlass, nvjet); on CPU oneDNN's verbose log names the "
                "implementation (`..._amx` = AMX tiles) and the data type. fp32 matmuls on CPU go to the "
                "BLAS library, which logs no kernel name, so the profile can only show they were not "
                "reduced-precision oneDNN primitives."
            )
            sections.append((f"Kernel check{label}", kblocks))

        fp16_rows = []
        for r in group.runs:
            h = diagnostics.loss_scale_health(r.rows)
            if h:
                fp16_rows.append(
                    [
                        r.name,
                        _fmt(h["initial_scale"], ".0f"),
                        _fmt(h["final_scale"], ".0f"),
                        _fmt(h["min_scale"], ".0f"),
                        str(h["scale_drops"]),
                        str(h["skipped_steps"]),
                    ]
                )
        if fp16_rows:
            sections.append(
                (
                    f"fp16 health{label}",
                    [
                        Table(
                            [
                                "run",
                                "initial scale",
                                "final scale",
                                "min scale",
                                "scale drops",
                                "skipped steps",
                            ],
                            fp16_rows,
                        )
                    ],
                )
            )

        flag_rows = []
        for r in group.runs:
            p = (r.summary or {}).get("precision") or {}
            mm = p.get("matmul") or {}
            flag_rows.append(
                [
                    r.name,
                    r.status,
                    str(p.get("autocast_dtype") or ("-" if p else "")),
                    str(p.get("loss_scaler", "")),
                    str(mm.get("float32_matmul_precision", "")),
                    str(mm.get("cuda_matmul_allow_tf32", "")),
                    str(mm.get("cudnn_allow_tf32", "")),
                    str(mm.get("mkldnn_matmul_fp32_precision", "")),
                    str(p.get("note") or r.entry.get("reason") or ""),
                ]
            )
        sections.append(
            (
                f"Flags that took effect{label}",
                [
                    Table(
                        [
                            "run",
                            "status",
                            "autocast",
                            "loss scaler",
                            "fp32 matmul precision",
                            "CUDA TF32",
                            "cuDNN TF32",
                            "oneDNN fp32 precision",
                            "note",
                        ],
                        flag_rows,
                    )
                ],
            )
        )
        plots = _plot_group(group, rules, root / "plots")
        if plots:
            sections.append((f"Plots{label}", [Image(c, p) for c, p in plots]))
        summary_groups.append(
            {
                "name": group.name,
                "axes": group.axes,
                "verdicts": {
                    n: {k: v for k, v in d.items() if k in ("status", "reasons", "checks")}
                    for n, d in verdicts.items()
                },
                "comparison": {n: d.get("comparison") for n, d in verdicts.items() if d.get("comparison")},
                "speed_ladder": ladder,
                "memory": {r.name: (r.summary or {}).get("memory") for r in group.runs},
                "probes": {
                    p: {k: v for k, v in (pr or {}).items() if k in ("measured_bytes", "kernel_verdict")}
                    for p, pr in probes.items()
                },
                "fp16": {
                    r.name: {k: v for k, v in h.items() if k != "trajectory"}
                    for r in group.runs
                    if (h := diagnostics.loss_scale_health(r.rows))
                },
                "plots": [p.relative_to(root).as_posix() for _, p in plots],
            }
        )

    skipped = [r for r in all_runs if r.status in ("skipped", "failed", "stopped", "pending")]
    if skipped:
        sections.append(
            (
                "Skipped and unfinished runs",
                [
                    Table(
                        ["run", "status", "reason"],
                        [[r.name, r.status, (_error_suffix(r)[2:] or "-")] for r in skipped],
                    )
                ],
            )
        )

    title = "bert_mp precision sweep report"
    atomic_write_text(root / "report.md", _md(sections, root, title))
    atomic_write_text(root / "report.html", _html(sections, title))
    out = {
        "sweep_dir": str(root),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": prec0.get("device_name"),
        "versions": versions,
        "rules": rules.__dict__,
        "groups": summary_groups,
        "runs": [
            {**r.entry, "status": r.status, "precision_flags": (r.summary or {}).get("precision")}
            for r in all_runs
        ],
    }
    atomic_write_json(root / "summary.json", out)
    return out


def verdict_lines(summary: dict[str, Any]) -> list[str]:
    """A compact verdict table for the terminal."""
    lines = []
    for g in summary["groups"]:
        ladder = {r["name"]: r for r in g["speed_ladder"]}
        for name, v in g["verdicts"].items():
            sp = (ladder.get(name) or {}).get("speedup_vs_fp32")
            speed = f"{sp:.2f}x fp32 speed" if sp else ""
            why = "; ".join(x for x in v.get("reasons", []) if x)
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
