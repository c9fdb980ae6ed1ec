"""A sweep folder's runs, grouped, and their loss-parity verdicts against each group's fp32 reference.

Reads the sweep manifest (``sweep.json``, written by ``bert_mp.sweep.runner``) and every run folder
(``summary.json`` + ``metrics.jsonl``, see docs/architecture.md); the verdicts are recomputed from
the run data every time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from bert_mp.core.config import SweepConfig
from bert_mp.core.storage.files import read_jsonl
from bert_mp.pretrain.parity_monitor import Curves, curves_from_rows
from bert_mp.sweep import diagnostics, parity
from bert_mp.sweep.record import RunEntry, RunSummary, SweepRecord, strict_record


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
    def curves(self) -> Curves:
        return curves_from_rows(self.rows)

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
                "reasons": [f"run is {run.status} with no metrics" + error_suffix(run)],
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
        d["reasons"].append(error_suffix(run).strip(": ") or "")
    return d


def error_suffix(run: Run) -> str:
    err = run.problem
    return f": {err}" if err else ""
