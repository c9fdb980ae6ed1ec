"""Atomic training checkpoints, discovery of the latest complete one, and the HF export.

A checkpoint is written into ``checkpoints/.tmp-step_XXXXXXXX``: ``accelerator.save_state`` (model,
optimizer, scaler, scheduler, RNG of every rank), then ``loop_state.json`` (step, epoch, data
position), then the ``COMPLETE`` marker listing every file with its size, and only then renamed to
``checkpoints/step_XXXXXXXX``. A folder without the marker, or whose files do not match it (a
truncated write), is never loaded: :func:`find_latest` skips it with a warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

from bert_mp.core.export import finish_hf_folder
from bert_mp.core.io import atomic_write_json
from bert_mp.errors import TrainingError

MARKER = "COMPLETE"
LOOP_STATE = "loop_state.json"
_NAME = re.compile(r"^step_(\d{8})$")

PAUSE_ENV = "BERT_MP_CHECKPOINT_PAUSE"
"""Fault-drill hook: ``<step>:<stage>:<ready file>`` makes the write of checkpoint ``step`` stop at
``stage`` (one of :data:`WRITE_STAGES`), create the ready file and wait there, so that a drill's
SIGKILL lands inside the write deterministically instead of by racing a poll loop."""
WRITE_STAGES = ("empty", "state", "loop_state", "marker")
"""Points inside a write: folder created; model/optimizer/RNG saved; loop_state.json; marker, not renamed."""
_PAUSE_LIMIT_S = 600.0


def _pause_point(step: int, stage: str) -> None:
    """Wait at ``stage`` of step ``step``'s write when :data:`PAUSE_ENV` asks for it (drills only)."""
    spec = os.environ.get(PAUSE_ENV)
    if not spec:
        return
    want_step, want_stage, ready = spec.split(":", 2)
    if int(want_step) != step or want_stage != stage:
        return
    Path(ready).write_text(f"{step}:{stage}\n", encoding="utf-8")
    deadline = time.monotonic() + _PAUSE_LIMIT_S  # never hang a run whose drill went away
    while time.monotonic() < deadline:
        time.sleep(0.05)


def checkpoint_name(step: int) -> str:
    """Folder name of the checkpoint taken after ``step`` optimizer steps."""
    return f"step_{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _manifest(folder: Path) -> dict[str, int]:
    """Relative path -> size of every file in ``folder`` except the marker."""
    return {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MARKER
    }


def write_marker(folder: Path) -> None:
    """Write the completion marker last: it lists what a complete checkpoint holds."""
    atomic_write_json(folder / MARKER, {"files": _manifest(folder)})


def verify(folder: Path) -> str | None:
    """None when ``folder`` is a complete checkpoint, else why it is not."""
    marker = folder / MARKER
    if not marker.is_file():
        return "no COMPLETE marker (interrupted while saving)"
    try:
        expected = json.loads(marker.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "unreadable COMPLETE marker"
    if not isinstance(expected, dict):  # valid JSON of another shape must not crash the scan
        return "unreadable COMPLETE marker"
    actual = _manifest(folder)
    for name, size in expected.items():
        if name not in actual:
            return f"missing file {name}"
        if actual[name] != size:
            return f"{name} has {actual[name]} bytes, expected {size} (truncated or altered)"
    if LOOP_STATE not in expected:
        return f"no {LOOP_STATE}"
    return None


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Checkpoint folders (complete or not) in step order; temporary folders excluded."""
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if p.is_dir() and _NAME.match(p.name)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))  # type: ignore[union-attr]


def find_latest(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint; incomplete or corrupt ones are skipped with a warning."""
    for folder in reversed(list_checkpoints(Path(ckpt_dir))):
        problem = verify(folder)
        if problem is None:
            return folder
        warnings.warn(f"skipping checkpoint {folder}: {problem}", stacklevel=2)
    return None


def resolve_resume(resume: str, ckpt_dir: Path, key: str = "train.resume") -> Path | None:
    """``latest`` -> newest complete checkpoint (None when there is none); a path -> that, verified."""
    if resume == "latest":
        return find_latest(ckpt_dir)
    folder = Path(resume).expanduser()
    if (folder / "checkpoints").is_dir() and not (folder / MARKER).is_file():
        raise TrainingError(
            f"{key}={resume}: is a run folder; to continue it set its output_dir to {resume} with "
            f"{key}=latest, or name one of its checkpoints/step_* folders"
        )
    if (folder / "config.json").is_file() and not (folder / MARKER).is_file():
        raise TrainingError(
            f"{key}={resume}: is a Hugging Face export (weights only, no optimizer or data "
            f"position), not a checkpoint; resume its run with {key}=latest, or start a new run "
            f"from its weights with model.init_from={resume}"
        )
    problem = verify(folder) if folder.is_dir() else "no such folder"
    if problem:
        raise TrainingError(f"{key}={resume}: cannot resume from it: {problem}")
    return folder


def save_checkpoint(accelerator: Any, ckpt_dir: Path, step: int, loop_state: dict, total_limit: int) -> Path:
    """Save atomically on every rank (collective); returns the final folder.

    A failing write (disk full, permissions) removes the partial folder and raises
    :class:`TrainingError`; the complete checkpoints already on disk are left untouched.
    """
    ckpt_dir = Path(ckpt_dir)
    final = ckpt_dir / checkpoint_name(step)
    tmp = ckpt_dir / f".tmp-{checkpoint_name(step)}"
    try:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            _pause_point(step, "empty")
        accelerator.wait_for_everyone()
        with _quiet_tied_weights():
            accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            _pause_point(step, "state")
            atomic_write_json(tmp / LOOP_STATE, loop_state)
            _pause_point(step, "loop_state")
            write_marker(tmp)
            _fsync_dir(tmp)
            _pause_point(step, "marker")
            if final.exists():  # a re-run of the same step (e.g. after a resume) replaces it
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(ckpt_dir)
            rotate(ckpt_dir, total_limit)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint only holds space
        previous = next((p for p in reversed(list_checkpoints(ckpt_dir)) if verify(p) is None), None)
        kept = (
            f"the previous checkpoint {previous.name} is intact"
            if previous
            else "no earlier checkpoint exists"
        )
        raise TrainingError(
            f"could not write checkpoint {final.name} in {ckpt_dir}: {e}; {kept}. Free disk space and rerun "
            "with train.resume=latest."
        ) from e
    accelerator.wait_for_everyone()
    return final


@contextlib.contextmanager
def _quiet_tied_weights():
    """Silence Accelerate's per-save notice that the tied MLM decoder weight was de-duplicated.

    The decoder shares the word-embedding matrix; safetensors stores it once and loading re-ties it
    (the exact-resume test covers this), so the notice is noise on every checkpoint.
    """
    log = logging.getLogger("accelerate.utils.other")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def rotate(ckpt_dir: Path, total_limit: int) -> None:
    """Keep the ``total_limit`` newest complete checkpoints; drop older ones and stale temp folders."""
    complete = [p for p in list_checkpoints(ckpt_dir) if verify(p) is None]
    for old in complete[:-total_limit]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in ckpt_dir.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)


def load_checkpoint(accelerator: Any, folder: Path) -> dict:
    """Restore model/optimizer/scaler/scheduler/RNG from a verified checkpoint; returns the loop state."""
    folder = Path(folder)
    problem = verify(folder)
    if problem:
        raise TrainingError(f"checkpoint {folder} is not complete: {problem}")
    accelerator.load_state(str(folder))
    return json.loads((folder / LOOP_STATE).read_text(encoding="utf-8"))


def export_pretrained(
    accelerator: Any, wrapped: Any, tokenizer: Any, out_dir: Path, card_facts: dict | None = None
) -> Path | None:
    """Write ``final/``: the plain ``BertForPreTraining`` via ``save_pretrained`` (safetensors) + tokenizer,
    with the tokenizer's length limit and a model card (:func:`bert_mp.export.finish_hf_folder`).

    ``wrapped`` is the prepared :class:`bert_mp.model.bert.PretrainingModel`; its full state dict is
    gathered (FSDP / DeepSpeed safe) and the ``model.`` prefix stripped so keys are HF-native.
    """
    out_dir = Path(out_dir)
    state = accelerator.get_state_dict(wrapped)
    inner = accelerator.unwrap_model(wrapped).model
    if accelerator.is_main_process:
        tmp = out_dir.with_name(f".tmp-{out_dir.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        hf_state = {k.removeprefix("model."): v for k, v in state.items()}
        inner.save_pretrained(tmp, state_dict=hf_state, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        finish_hf_folder(tmp, "pretraining", inner.config.max_position_embeddings, card_facts or {})
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    accelerator.wait_for_everyone()
    return out_dir
