"""What a command that runs many fine-tunes (``bert-mp glue``, a sweep's downstream step) does with a
fine-tuning folder it finds again: keep a finished run, resume a stopped one, or train it again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bert_mp.core.process.run_dir import changed_since, describe_changes, holds_run, read_status

RESUME = {"resume": ["finetune.resume=latest"], "again": ["finetune.overwrite_output_dir=true"]}
"""The overrides each action adds to the fine-tune's config (``keep`` and ``fresh``: none)."""


def folder_action(
    cfg: Any, keep: tuple[str, ...] = ("completed",), source: Path | None = None
) -> tuple[str, str]:
    """``(keep | resume | again | fresh, why)`` for ``cfg.finetune.output_dir``: a run whose status is in
    ``keep`` and whose config is ``cfg``'s is kept - unless ``source`` (its checkpoint folder) was
    written again since -; a stopped run with a checkpoint resumes; any other run there is trained
    again, an empty folder freshly."""
    from bert_mp.core.checkpoint.store import find_latest

    out = Path(cfg.finetune.output_dir)
    changed = changed_since(out, cfg, "finetune")
    if changed:
        return "again", f"config changed since its run ({describe_changes(changed)})"
    summary = out / "summary.json"
    if read_status(out) in keep:
        written = source / "config.json" if source is not None else None
        if written is not None and written.is_file() and written.stat().st_mtime > summary.stat().st_mtime:
            return "again", "its checkpoint was written again since"
        return "keep", f"{read_status(out)} earlier"
    if (out / "checkpoints").is_dir() and find_latest(out / "checkpoints") is not None:
        return "resume", "stopped earlier"
    if holds_run(out):
        return "again", "interrupted earlier, before any checkpoint"
    return "fresh", ""
