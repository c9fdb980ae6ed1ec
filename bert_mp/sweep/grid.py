"""The precision x optimizer grid of a sweep with ``sweep.optimizers``: one cell per run.

Each optimizer is its own group (judged against its own fp32 runs), so the grid only lays the
groups' verdicts side by side: verdict, speed-up over that optimizer's fp32, non-activation memory
(weights + gradients + optimizer state, from the memory probe) and the final evaluation MLM loss.
"""

from __future__ import annotations

from typing import Any

OPTIMIZER_AXIS = "train.optimizer"
STATE = ("weights", "gradients", "optimizer_state")


def _cell(ga: Any, run: Any) -> dict[str, Any]:
    ladder = {r["name"]: r for r in ga.ladder}
    verdict = ga.verdicts.get(run.name, {}).get("status") if run.role != "reference" else "reference"
    probe = ga.probes.get(run.precision) or {}
    mb = probe.get("measured_bytes") or {}
    final = ((run.summary.raw if run.summary else {}) or {}).get("final_eval") or {}
    return {
        "verdict": verdict or run.status,
        "speedup_vs_fp32": (ladder.get(run.name) or {}).get("speedup_vs_fp32"),
        "speed_withheld": bool((ladder.get(run.name) or {}).get("withheld")),
        "state_bytes": sum(mb.get(k, 0) for k in STATE) if mb else None,
        "final_eval_loss_mlm": final.get("eval/loss_mlm"),
        "emulated": bool(((run.summary.precision if run.summary else {}) or {}).get("emulated")),
    }


def grid_summary(analyses: list[Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{optimizer: {precision: cell}}`` over the groups that vary the optimizer (empty if none do)."""
    grid: dict[str, dict[str, dict[str, Any]]] = {}
    for ga in analyses:
        opt = ga.group.axes.get(OPTIMIZER_AXIS)
        if opt is None:
            continue
        cells = grid.setdefault(str(opt), {})
        for run in ga.group.runs:
            if run.role not in ("seed_spread", "recipe"):  # a recipe run is not the precision's cell
                cells[run.precision] = _cell(ga, run)
    return grid


def _text(c: dict[str, Any], fmt_bytes: Any) -> str:
    verdict = str(c["verdict"]).upper()
    speed = f"{c['speedup_vs_fp32']:.2f}x" if c["speedup_vs_fp32"] else "-"
    if c.get("speed_withheld"):
        speed = "speed withheld"
    loss = f"{c['final_eval_loss_mlm']:.3f}" if c["final_eval_loss_mlm"] is not None else "-"
    emulated = " (emulated)" if c["emulated"] else ""
    return f"{verdict}; {speed}{emulated}; {fmt_bytes(c['state_bytes'])}; loss {loss}"


def grid_section(analyses: list[Any], table: Any, fmt_bytes: Any) -> list[tuple[str, list[Any]]]:
    """The report section: rows are precisions, columns optimizers (nothing without the axis)."""
    grid = grid_summary(analyses)
    if not grid:
        return []
    optimizers = list(grid)
    precisions = list(dict.fromkeys(p for cells in grid.values() for p in cells))
    rows = [
        [p, *(_text(grid[o][p], fmt_bytes) if p in grid[o] else "-" for o in optimizers)] for p in precisions
    ]
    note = (
        "Each cell: verdict against the same optimizer's fp32 runs; speed-up over that fp32 run (emulated "
        "modes prove numerics, not speed; withheld where that optimizer's two fp32 runs disagree in speed, "
        "see its speed ladder); parameter state (weights + gradients + optimizer state, "
        "measured by the memory probe); final evaluation MLM loss."
    )
    return [("Precision x optimizer", [table(["precision", *optimizers], rows), note])]
