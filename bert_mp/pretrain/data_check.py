"""Pretraining's addition to the run-folder check (:func:`bert_mp.core.process.run_dir.check_output_dir`):
a resume onto prepared data rebuilt with other bytes is refused (unless ``train.allow_data_change``),
before any work where that data exists already."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bert_mp.core.checkpoint import store as ckpt
from bert_mp.data.fingerprint import same_data
from bert_mp.errors import TrainingError


def check_resume_data(cfg: Any, section: Any, folder: Path | None) -> None:
    """On a ``train`` resume (from ``folder``, the resolved checkpoint) of a run that has its
    config.yaml: the data check, unless ``train.allow_data_change``."""
    saved = Path(section.output_dir) / "config.yaml"  # without it, a resume starts afresh
    if folder is not None and saved.is_file() and not section.allow_data_change:
        check_data_unchanged(cfg, folder)


def data_change_error(resumed_from: Any, trained_on: str, data_path: Any, now: str) -> TrainingError:
    """A resume onto prepared data whose bytes changed since the checkpoint (``prepare --force``)."""
    return TrainingError(
        f"train.resume: {resumed_from} was trained on data with fingerprint {trained_on}, but "
        f"{data_path} now holds {now} (rebuilt from other data); prepare the original data again, or "
        "set train.allow_data_change=true to continue on the new data (a fingerprint of the earlier form, "
        "which also hashed datasets' random state.json, matches no folder rebuilt since)"
    )


def check_data_unchanged(cfg: Any, folder: Path) -> None:
    """Before any work: refuse a resume whose prepared data now holds other bytes, where that data
    is prepared already (the trainer checks again once it has prepared or loaded it), so that the
    run folder is left as it was (config.yaml included)."""
    from bert_mp.data.prepare import cache_path, is_complete

    data = cache_path(cfg.data)
    if cfg.train.prepared or not is_complete(
        data
    ):  # train.prepared: the trainer checks once it has loaded it
        return
    state = ckpt.read_loop_state(folder)
    trained_on = (state.get("meta") or {}).get("data_fingerprint")
    stats = json.loads((data / "stats.json").read_text(encoding="utf-8"))
    now = stats.get("fingerprint")
    if not same_data(trained_on, data, now, stats.get("fingerprint_hash")):
        raise data_change_error(folder, trained_on, data, now)
