"""Runs that should be equally fast, compared: the cheapest noise check a sweep has.

A group's two fp32 runs differ only in their seed, and a run trained again (``sweep.rerun``) repeats
a measurement, so their step times should agree. Where a pair differs by more than
``sweep.speed_noise``, no speed-up of the group is quoted - not in the report, the terminal or the
plots - and one line names the two runs, their step times and the likely cause: other work during
one of them, or subnormal floats where its weights and optimizer state show them. A rerun whose
earlier measurement met other work while the new one did not replaces it: that is what the rerun
was for. The load each run met (what its start-up warning is about) is gathered here too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from bert_mp.sweep import diagnostics, fairness
from bert_mp.sweep.document import Block, Table, cost, fmt, pct
from bert_mp.sweep.results import GroupResult, Run

SUBNORMAL_SHARE_SHOWN = 1e-3
"""A run "shows" subnormal floats when at least this share of its weights' and optimizer state's
fp32 / bf16 values was subnormal at its end (``conditions.subnormal_share``)."""


@dataclass
class PairCheck:
    """Two measurements that should agree: a group's fp32 seeds, or a run and its earlier measurement."""

    kind: str
    """``seeds`` (the reference and the other fp32 seed) or ``rerun`` (the same run, measured twice)."""
    first: str
    second: str
    first_ms: float
    second_ms: float
    noise: float
    """The stated noise bound (``sweep.speed_noise``): agreement within this relative spread."""
    cause: str = ""
    """Why they may differ (empty where they agree)."""
    superseded: bool = False
    """A rerun whose earlier measurement met other work and the new one did not: explained, and
    replaced by the rerun, so nothing is withheld for it."""
    unmatched: str = ""
    """What differs between the two runs' conditions other than load (threads, processes, cores,
    devices, flushing): then they are not expected to run equally fast, and are not compared."""

    @property
    def ratio(self) -> float:
        return max(self.first_ms, self.second_ms) / min(self.first_ms, self.second_ms)

    @property
    def agree(self) -> bool:
        return self.ratio - 1 <= self.noise

    @property
    def withholds(self) -> bool:
        return not self.agree and not self.superseded and not self.unmatched

    def line(self) -> str:
        a, b = f"{self.first} ({self.first_ms:.1f} ms/step)", f"{self.second} ({self.second_ms:.1f} ms/step)"
        if self.unmatched:
            return f"{a} and {b} were measured under other conditions ({self.unmatched}): not compared"
        if self.agree:
            return f"{a} and {b} agree within {self.ratio - 1:.0%} (noise bound {self.noise:.0%})"
        if self.superseded:
            return (
                f"{self.second} measured again: {self.second_ms:.1f} ms/step, against {self.first_ms:.1f} ms/step "
                f"earlier; {self.cause}: the rerun replaces the earlier measurement"
            )
        return (
            f"speed-ups withheld: {a} and {b} should run equally fast but differ {self.ratio:.2f}x, beyond "
            f"the {self.noise:.0%} noise bound; likely cause: {self.cause}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "agree": self.agree, "withholds": self.withholds}


def step_ms(summary: dict[str, Any] | None) -> float | None:
    """Mean step time of a run summary (after the throughput monitor's warm-up), or None."""
    value = ((summary or {}).get("throughput") or {}).get("step_ms")
    return float(value) if value else None


def _cond(run: Run) -> dict[str, Any] | None:
    return run.summary.conditions if run.summary else None


def others(cond: dict[str, Any] | None) -> str:
    """``other processes used 1.9 of 2 cores on average`` (the load at the start where that is all)."""
    if not cond:
        return "conditions not recorded"
    if cond.get("others_cpu_cores") is not None:
        return f"other processes used {cond['others_cpu_cores']:.1f} of {cond['cores']} cores on average"
    load = cond.get("load_start")
    return (
        f"a load average of {load[0]:.2f} at its start on {cond['cores']} cores"
        if load
        else "load not recorded"
    )


def likely_cause(a: str, cond_a: dict[str, Any] | None, b: str, cond_b: dict[str, Any] | None) -> str:
    """What the records say about why runs ``a`` and ``b`` (measured under the same threads, processes
    and devices) ran at different speeds: the load either met, subnormal floats either shows."""
    busy = [(n, c) for n, c in ((a, cond_a), (b, cond_b)) if c and fairness.is_busy(c)]
    parts = []
    if len(busy) == 1:
        parts.append(f"other work loaded the machine during {busy[0][0]} ({others(busy[0][1])})")
    elif busy:
        parts.append(f"other work during both ({a}: {others(cond_a)}; {b}: {others(cond_b)})")
    for name, cond in ((a, cond_a), (b, cond_b)):
        share = (cond or {}).get("subnormal_share")
        if share is not None and share >= SUBNORMAL_SHARE_SHOWN and cond.get("flush_denormal") != "on":
            parts.append(
                f"subnormal floats: {share:.1%} of {name}'s weights and optimizer state were subnormal at its "
                "end, which the CPU computes with tens of times slower (hardware.flush_denormal=true flushes them)"
            )
    if not parts:
        parts.append(
            "nothing recorded: neither run met other work or left subnormal floats; measure both again "
            f"(sweep.rerun=[{a},{b}]) on an otherwise idle machine"
        )
    return "; ".join(parts)


def unmatched(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str:
    """What differs between two runs' conditions other than the load they met ("": nothing)."""
    if not a or not b:
        return ""
    return "; ".join(
        d for d in fairness.differences(a, b) if "other work" not in d and "beside other" not in d
    )


def pair_checks(group: GroupResult, noise: float) -> list[PairCheck]:
    """Every pair of the group that should run equally fast and has step times: its fp32 seeds, and
    each rerun run against its previous measurement."""
    out = []
    ref, spread = group.by_role("reference"), group.by_role("seed_spread")
    if ref and spread and ref.summary and spread.summary:
        ta, tb = step_ms(ref.summary.raw), step_ms(spread.summary.raw)
        if ta and tb:
            check = PairCheck(
                "seeds", ref.name, spread.name, ta, tb, noise, unmatched=unmatched(_cond(ref), _cond(spread))
            )
            if not check.agree:
                check.cause = likely_cause(ref.name, _cond(ref), spread.name, _cond(spread))
            out.append(check)
    for run in group.runs:
        earlier = run.entry.earlier[-1] if run.entry.earlier else None
        now = step_ms(run.summary.raw) if run.summary else None
        if not earlier or not now or not earlier.get("step_ms"):
            continue
        before, after = earlier.get("conditions"), _cond(run)
        check = PairCheck(
            "rerun",
            f"{run.name} (earlier)",
            run.name,
            float(earlier["step_ms"]),
            now,
            noise,
            unmatched=unmatched(before, after),
        )
        if not check.agree and not check.unmatched:
            check.superseded = bool(before and fairness.is_busy(before)) and not (
                after and fairness.is_busy(after)
            )
            check.cause = (
                f"the earlier measurement met other work ({others(before)}), this one did not"
                if check.superseded
                else likely_cause(check.first, before, run.name, after)
            )
        out.append(check)
    return out


def withhold(ladder: list[dict[str, Any]], checks: list[PairCheck]) -> list[dict[str, Any]]:
    """The speed ladder with every speed-up withheld (``withheld``: the lines why) when a pair of the
    group disagrees."""
    lines = [c.line() for c in checks if c.withholds]
    if lines:
        for row in ladder:
            row["speedup_vs_fp32"] = None
            row["withheld"] = " ".join(lines)
    return ladder


def checked_ladder(group: GroupResult, noise: float) -> tuple[list[dict[str, Any]], list[PairCheck]]:
    """The group's speed ladder - every run, the second fp32 seed too - with its speed-ups withheld
    where conditions differ from the reference's or the equal-speed check fails; and the checks."""
    with_summary = [
        {"name": r.name, "precision": r.precision, "summary": r.summary.raw} for r in group.runs if r.summary
    ]
    ref = group.by_role("reference")
    checks = pair_checks(group, noise)
    ladder = diagnostics.speed_ladder(with_summary, reference=ref.name if ref else "fp32")
    return withhold(fairness.withhold_speedups(ladder, unequal_conditions(group)), checks), checks


def load_notes(group: GroupResult) -> list[str]:
    """One line per run that other work slowed, measured over the whole run; and one for the runs whose
    start-up warning (the load average above the cores) the measurement did not bear out."""
    notes, unborne = [], []
    for run in group.runs:
        cond = _cond(run)
        if not cond:
            continue
        load = " -> ".join(f"{x[0]:.2f}" for x in (cond.get("load_start"), cond.get("load_end")) if x)
        if fairness.is_busy(cond):
            notes.append(f"{run.name}: {others(cond)} while it ran (load average {load or 'n/a'})")
        elif cond.get("load_start") and cond["load_start"][0] > cond["cores"]:
            unborne.append(run.name)
    if unborne:
        notes.append(
            f"{', '.join(unborne)}: the load average at the start was above the cores (their start-up warning), "
            "but other processes used little while they ran (it counts the minute before, the previous run's too)"
        )
    return notes


# --------------------------------------------------------------------------------------------------
# the report's speed sections: the speed ladder (with the equal-speed check) and the run conditions
# --------------------------------------------------------------------------------------------------
def unequal_conditions(group: GroupResult) -> dict[str, str]:
    """Runs of ``group`` measured under other conditions than its reference: name -> what differs."""
    ref = group.by_role("reference")
    runs = [(r.name, r.summary.conditions) for r in group.runs if r.summary]
    return fairness.unequal_runs(runs, ref.name) if ref else {}


def speedup_cell(row: dict[str, Any]) -> str:
    if row.get("withheld"):
        return "withheld (see above)"
    if row.get("conditions_differ"):
        return "not compared (conditions differ)"
    return fmt(row["speedup_vs_fp32"], ".2f") + ("x" if row["speedup_vs_fp32"] else "")


LADDER_HEADERS = ["run", "precision", "step ms", "tokens/s", "speed-up vs fp32", "MFU", "wall s / CPU s"]
LADDER_NOTE = (
    "Mean over the steps after the throughput monitor's warm-up; ratios compare runs of the same sweep "
    "on the same machine, and only where the runs that should be equally fast (the two fp32 seeds, a "
    "run and its rerun) agree within the noise bound (`sweep.speed_noise`). MFU is n/a where the "
    "device's peak FLOP/s for the precision is unknown (e.g. CPUs). The last column is the whole run "
    "process (start-up, evaluation, checkpoints included): wall time and the CPU seconds it used, which "
    "stay meaningful when other work shares the machine."
)


def speed_section(rep: Any, ga: Any) -> list[tuple[str, list[Block]]]:
    """The equal-speed check's lines, then every run's step time, tokens/s and speed-up."""
    entries = {r.name: r.entry for r in ga.group.runs}
    rows = [
        [
            r["name"],
            r["precision"],
            fmt(r["step_ms"], ".1f"),
            fmt(r["tokens_per_sec"], ".0f"),
            speedup_cell(r),
            pct(r["mfu"]) if r["mfu"] is not None else "n/a",
            cost(entries.get(r["name"])),
        ]
        for r in ga.ladder
    ]
    checks: list[Block] = [
        f"**{c.line()}.**"
        if c.withholds
        else f"{'Rerun' if c.kind == 'rerun' else 'Equal-speed check'}: {c.line()}."
        for c in ga.speed_checks
    ]
    return [(f"Speed ladder{ga.label}", [*checks, Table(LADDER_HEADERS, rows), LADDER_NOTE])]


CONDITION_HEADERS = [
    "run",
    "threads",
    "processes",
    "cores",
    "load at start -> end",
    "others' cores",
    "device",
]


def conditions_section(rep: Any, ga: Any) -> list[tuple[str, list[Block]]]:
    """What each run was measured under, the load the runs met, and which speed-ups are not compared
    because their conditions differ from the reference's."""
    rows = []
    for r in ga.group.runs:
        c = r.summary.conditions if r.summary else None
        if not c:
            rows.append([r.name, "not recorded", "", "", "", "", ""])
            continue
        load = " -> ".join(f"{x[0]:.1f}" for x in (c.get("load_start"), c.get("load_end")) if x) or "n/a"
        gpu = (c.get("gpu") or {}).get("name")
        rows.append(
            [
                r.name,
                f"{c['threads']} ({c['threads_source']})",
                str(c["processes"]),
                str(c["cores"]),
                load,
                fmt(c.get("others_cpu_cores"), ".1f"),
                gpu or c.get("cpu_model", ""),
            ]
        )
    unequal = {r["name"]: r["conditions_differ"] for r in ga.ladder if r.get("conditions_differ")}
    blocks: list[Block] = [Table(CONDITION_HEADERS, rows)]
    if ga.load_notes:
        blocks.append("Load the runs met: " + "; ".join(ga.load_notes) + ".")
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
    elif not any(
        r.summary and r.summary.conditions and fairness.is_busy(r.summary.conditions) for r in ga.group.runs
    ):
        blocks.append(
            "Every run was measured under the same threads, processes and devices, none beside other work "
            "(others' cores: CPU cores other processes used on average while the run ran)."
        )
    return [(f"Run conditions{ga.label}", blocks)]
