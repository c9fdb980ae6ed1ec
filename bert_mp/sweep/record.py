"""The files ``bert-mp sweep`` writes and ``bert-mp report`` reads, as typed records.

``sweep.json`` is a :class:`SweepRecord` (its ``downstream`` list: one :class:`DownstreamEntry` per
fine-tune of ``sweep.downstream``); each run folder's ``summary.json`` is read as a
:class:`RunSummary`, each fine-tune's as a :class:`FinetuneSummary`. Reading is strict: a missing or unknown field is an error that names the file
and the field, never a silent default.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from bert_mp.core.storage.files import atomic_write_json
from bert_mp.errors import ConfigError

MANIFEST = "sweep.json"
BASE_CONFIG = "base_config.yaml"
SUMMARY = "summary.json"
FINAL_STATUSES = ("completed", "failed")
"""A run whose summary.json has one of these is a result and is not repeated on a re-run."""


def strict_record(cls: type, d: Any, where: str, require_all: bool = False) -> Any:
    """``cls(**d)`` with every required field (``require_all``: every field) present and no unknown
    one; errors name the field."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected an object, got {type(d).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(d) - set(known))
    missing = [
        n
        for n, f in known.items()
        if n not in d and (require_all or (f.default is MISSING and f.default_factory is MISSING))
    ]
    if unknown or missing:
        what = "; ".join(
            part
            for part in (
                f"missing field(s) {', '.join(missing)}" if missing else "",
                f"unknown field(s) {', '.join(unknown)}" if unknown else "",
            )
            if part
        )
        raise ConfigError(f"{where}: {what} (written by another bert_mp version?)")
    return cls(**d)


@dataclass
class RunEntry:
    """One training process of a sweep, as planned and as it went."""

    name: str
    group: str
    precision: str
    role: str
    """reference (fp32, the group's seed) | seed_spread (fp32, another seed) | candidate | recipe (a
    candidate that also changes the recipe, ``sweep.recipes``)."""
    seed: int
    overrides: list[str]
    dir: str
    """Relative to the sweep folder."""
    status: str = "pending"
    reason: str | None = None
    returncode: int | None = None
    wall_s: float | None = None
    cpu_s: float | None = None
    resumed: bool = False
    earlier: list[dict[str, Any]] = field(default_factory=list)
    """The measurements this run replaced when ``sweep.rerun`` trained it again: ``step_ms``,
    ``tokens_per_sec`` and ``conditions`` of each, oldest first (the report compares the newest with
    the run's current one)."""


@dataclass
class DownstreamEntry:
    """One fine-tune of ``sweep.downstream``: a run's final checkpoint on one task with one seed."""

    run: str
    """The pretraining run's name (its :class:`RunEntry`'s)."""
    group: str
    precision: str
    """The pretraining run's precision (the fine-tune's own is the finetune section's)."""
    role: str
    task: str
    seed: int
    dir: str
    """Relative to the sweep folder."""
    status: str = "pending"
    reason: str | None = None
    returncode: int | None = None
    wall_s: float | None = None
    cpu_s: float | None = None
    resumed: bool = False


@dataclass
class GroupEntry:
    """Runs that share every axis but precision."""

    name: str
    axes: dict[str, Any]


@dataclass
class HostInfo:
    description: str
    python: str


@dataclass
class SweepRecord:
    """``sweep.json``: the plan, the resolved config and how each run went."""

    created: str
    sweep_file: str | None
    base: str | None
    launcher: str
    host: HostInfo
    config: dict[str, Any]
    """The resolved config tree (``config_to_dict``)."""
    groups: list[GroupEntry]
    runs: list[RunEntry]
    dimension_flags: dict[str, list[str]] = field(default_factory=dict)
    downstream: list[DownstreamEntry] = field(default_factory=list)
    """The fine-tunes of ``sweep.downstream`` (empty without it)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = MANIFEST) -> SweepRecord:
        rec = strict_record(cls, d, where)
        rec.host = strict_record(HostInfo, d["host"], f"{where}: host")
        rec.groups = [
            strict_record(GroupEntry, g, f"{where}: groups[{i}]") for i, g in enumerate(d["groups"])
        ]
        rec.runs = [strict_record(RunEntry, r, f"{where}: runs[{i}]") for i, r in enumerate(d["runs"])]
        rec.downstream = [
            strict_record(DownstreamEntry, r, f"{where}: downstream[{i}]")
            for i, r in enumerate(d.get("downstream", []))
        ]
        return rec

    def write(self, root: Path) -> None:
        atomic_write_json(Path(root) / MANIFEST, self.to_dict())

    @classmethod
    def load(cls, root: str | Path) -> SweepRecord:
        path = Path(root) / MANIFEST
        if not path.is_file():
            raise ConfigError(
                f"{root} is not a sweep folder: {MANIFEST} is missing (run `bert-mp sweep` first)"
            )
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")), str(path))


@dataclass
class RunSummary:
    """A training run's ``summary.json`` as the report reads it.

    The blocks a callback writes (``throughput``, ``memory``, ``amp``, ``parity``) are None when that
    callback was not enabled; every other field is always written by the training loop.
    """

    status: str
    steps: int
    precision: dict[str, Any]
    versions: dict[str, str]
    final_eval: dict[str, Any] | None
    stop_reason: str | None = None
    error: str | None = None
    throughput: dict[str, Any] | None = None
    memory: dict[str, Any] | None = None
    amp: dict[str, Any] | None = None
    parity: dict[str, Any] | None = None
    conditions: dict[str, Any] | None = None
    """Threads, processes, cores, load and devices the run was measured under (None: written before
    bert_mp recorded them); see :mod:`bert_mp.core.process.conditions`."""
    strategy: dict[str, Any] | None = None
    """The distributed strategy the run was under (single, DDP, FSDP, DeepSpeed; what it shards; None:
    written before bert_mp recorded it); see :mod:`bert_mp.core.engine.strategy`."""
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    """The whole file, for the fields the report passes through unread."""

    @classmethod
    def load(cls, run_dir: Path) -> RunSummary | None:
        """The run's summary, or None when it wrote none (killed early, never started)."""
        return _load_summary(cls, run_dir, ("versions", "final_eval"), "train")


@dataclass
class FinetuneSummary:
    """A fine-tune's ``summary.json`` as the downstream verdict reads it (``bert-mp finetune`` writes it)."""

    status: str
    steps: int
    precision: dict[str, Any]
    task: dict[str, Any] | None = None
    """Name, labels, sizes; absent from a run that failed before its data was read."""
    validation: dict[str, Any] | None = None
    test: dict[str, Any] | None = None
    other_splits: dict[str, Any] = field(default_factory=dict)
    stop_reason: str | None = None
    error: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, run_dir: Path) -> FinetuneSummary | None:
        """The fine-tune's summary, or None when it wrote none."""
        return _load_summary(cls, run_dir, (), "finetune")


def _load_summary(cls: type, run_dir: Path, required: tuple[str, ...], command: str) -> Any:
    """``cls`` from ``<run_dir>/summary.json`` (None where there is none); a summary without
    ``status``, ``steps``, ``precision`` or ``required`` is refused in one line."""
    path = Path(run_dir) / SUMMARY
    if not path.is_file():
        return None
    d = json.loads(path.read_text(encoding="utf-8"))
    missing = [k for k in ("status", "steps", "precision", *required) if k not in d]
    if missing:
        raise ConfigError(f"{path}: missing field(s) {', '.join(missing)} (not a bert-mp {command} summary)")
    names = {f.name for f in fields(cls)} - {"raw"}
    return cls(**{k: v for k, v in d.items() if k in names}, raw=d)


def record_outcome(entry: Any, summary: Any, last_error: str | None) -> None:
    """A run's or fine-tune's ``status`` and ``reason`` from its summary (none written: failed); the
    reason is the summary's error or stop reason, else ``last_error`` (its launch.log's last error
    line). A non-zero exit after a completed summary is a failure."""
    entry.status = summary.status if summary else "failed"
    failed = entry.status != "completed" or entry.returncode not in (None, 0)
    entry.reason = ((summary and (summary.error or summary.stop_reason)) or last_error) if failed else None
    if entry.status == "completed" and failed:
        entry.status = "failed"
