"""The plots of one sweep group (PNG files under ``plots/``): losses, deviation from fp32,
throughput, memory and the fp16 loss scale."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bert_mp.sweep import parity
from bert_mp.sweep.record import RunSummary
from bert_mp.sweep.results import GroupResult, Run

COLORS = {"fp32": "black", "tf32": "tab:purple", "bf16": "tab:blue", "fp16": "tab:orange"}


def plot_group(
    group: GroupResult, rules: parity.VerdictRules, plots_dir: Path, withheld: str | None = None
) -> list[tuple[str, Path]]:
    """Every plot of one group, as (caption, path); plots without data are left out. ``withheld``: why
    the group's speed-ups are withheld (the equal-speed check's line), said on the throughput plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots_dir.mkdir(parents=True, exist_ok=True)
    return [
        *_plot_losses(plt, group, rules, plots_dir),
        *_plot_deviation(plt, group, rules, plots_dir),
        *_plot_throughput(plt, group, plots_dir, withheld),
        *_plot_memory(plt, group, rules, plots_dir),
        *_plot_loss_scale(plt, group, rules, plots_dir),
    ]


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
    """Every run with a summary, both fp32 seeds included."""
    return [(r.name, r.precision, r.summary) for r in group.runs if r.summary]


def _plot_throughput(plt: Any, group: GroupResult, plots_dir: Path, withheld: str | None) -> list:
    tps = [(n, p, (s.throughput or {}).get("tokens_per_sec")) for n, p, s in _measured(group)]
    tps = [t for t in tps if t[2]]
    if not tps:
        return []
    path = plots_dir / f"{group.name}_tokens_per_sec.png"
    title = f"Throughput ({group.name})"
    if withheld:  # the bars are what was measured; the ratios between them are not quoted
        title += "\nspeed-ups withheld: runs that should be equally fast differ"
    caption = "Throughput" + (" (speed-ups withheld: see the speed ladder)" if withheld else "")
    return [(caption, _bar(plt, tps, "tokens / s (non-padding)", title, path))]


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


def plot_headline(
    group: GroupResult,
    rules: parity.VerdictRules,
    ladder: list[dict[str, Any]],
    footer: str,
    path: Path,
) -> Path:
    """One small picture of a sweep group: the MLM loss per precision over the fp32 seed band, and the
    speed ladder (every run's step time; the speed-up beside it, or why it is withheld)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss, bars) = plt.subplots(1, 2, figsize=(9, 3.3), gridspec_kw={"width_ratios": [1.35, 1]})
    _seed_band(loss, group, "loss/mlm", rules.window)
    for run in group.runs:
        if run.rows and run.role != "seed_spread":
            s, v = _smoothed(run, "loss/mlm", rules.window)
            style = "-" if run.role == "reference" else "--"  # a curve on top of fp32's stays visible
            loss.plot(s, v, style, color=COLORS.get(run.precision), label=run.name, lw=1.3)
    loss.set_xlabel("step")
    loss.set_ylabel(f"MLM loss ({rules.window}-step mean)")
    loss.set_title("Loss by precision, fp32 seed band shaded", fontsize=10)
    loss.grid(alpha=0.3)
    loss.legend(fontsize=8)
    rows = [r for r in ladder if r.get("step_ms")]
    names = [r["name"] for r in rows][::-1]
    values = [r["step_ms"] for r in rows][::-1]
    colors = [COLORS.get(r["precision"], "grey") for r in rows][::-1]
    bars.barh(names, values, color=colors, alpha=0.8)
    withheld = any(r.get("withheld") or r.get("conditions_differ") for r in rows)
    for i, r in enumerate(rows[::-1]):
        sp = r.get("speedup_vs_fp32")
        label = f" {r['step_ms']:.0f} ms" + (f"  {sp:.2f}x" if sp and not withheld else "")
        bars.text(r["step_ms"], i, label, va="center", fontsize=8)
    bars.set_xlim(0, max(values, default=1) * 1.45)
    bars.set_xlabel("ms per step (lower is faster)")
    title = "Speed ladder" + (
        ": speed-ups withheld\n(runs that should be equally fast differ)" if withheld else ""
    )
    bars.set_title(title, fontsize=10 if not withheld else 9)
    bars.tick_params(axis="y", labelsize=8)
    fig.text(0.5, 0.01, footer, ha="center", fontsize=7, color="dimgrey")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=80, pil_kwargs={"optimize": True})
    plt.close(fig)
    return path
