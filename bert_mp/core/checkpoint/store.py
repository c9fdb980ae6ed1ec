"""Atomic training checkpoints, verified by content before anything is loaded; the HF export.

A checkpoint is written into ``checkpoints/.tmp-step_XXXXXXXX``: the training state without pickle
(:mod:`bert_mp.core.checkpoint.state_codec`: model, optimizer, scheduler, GradScaler, RNG of every rank, hashed
while written), then ``loop_state.json`` (step, epoch, data position), then the ``COMPLETE``
manifest listing every file with its size and xxh3-128 digest (:mod:`bert_mp.core.storage.checksums`), and
only then renamed to ``checkpoints/step_XXXXXXXX``. A folder without the manifest, or whose files
do not match it (truncated, a flipped bit, overwritten), is never loaded: :func:`find_latest` skips it
with a one-line warning, and naming it as ``train.resume`` is a one-line error. A failing write (disk
full) removes the partial folder and ends with one line (:class:`bert_mp.errors.StorageError`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from bert_mp.core.checkpoint import state_codec as state_io
from bert_mp.core.checkpoint.hf_folder import CHECKSUMS, finish_hf_folder
from bert_mp.core.process import notes
from bert_mp.core.process.hold import hold
from bert_mp.core.storage import checksums as integrity
from bert_mp.core.storage import disk as storage
from bert_mp.errors import BertMPWarning, TrainingError

MARKER = "COMPLETE"
"""The checkpoint's manifest (sizes and digests of every file), written last and verified before any
load. A prepared data folder's ``COMPLETE`` is only a finished-build stamp (``data/prepare/cache.py``)."""
LOOP_STATE = "loop_state.json"
_NAME = re.compile(r"^step_(\d{8})$")

WRITE_STAGES = ("empty", "state", "loop_state", "marker")
"""Points inside a write: folder created; model/optimizer/RNG saved; loop_state.json; marker, not renamed.
A drill holds the write of checkpoint N at one of them with ``BERT_MP_HOLD=checkpoint:N:STAGE``
(:mod:`bert_mp.core.process.hold`), so that its SIGKILL lands inside the write by construction."""


def checkpoint_name(step: int) -> str:
    """Folder name of the checkpoint taken after ``step`` optimizer steps."""
    return f"step_{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_ABSENT = "no COMPLETE marker (interrupted while saving)"


def verify(folder: Path) -> str | None:
    """None when ``folder`` is a complete checkpoint whose files match their recorded sizes and digests,
    else why it is not (a few words naming the file)."""
    verdict = integrity.check(folder, MARKER, _ABSENT, "COMPLETE marker")
    if verdict.problem:
        return verdict.problem
    if LOOP_STATE not in verdict.files:
        return f"no {LOOP_STATE}"
    return None


def is_hashed(folder: Path) -> bool:
    """Whether the checkpoint's manifest has content digests (False: an older, size-only one)."""
    return integrity.check(folder, MARKER, _ABSENT).hashed


def size_only_note(folder: Path) -> str:
    return (
        f"checkpoint {folder} has a size-only manifest (written before content checksums): its file sizes "
        "were checked, not their contents; its pickled files are read with weights_only=True"
    )


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Checkpoint folders (complete or not) in step order; temporary folders excluded."""
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if p.is_dir() and _NAME.match(p.name)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))  # type: ignore[union-attr]


def newest_verified(ckpt_dir: Path) -> Path | None:
    """The newest checkpoint that verifies, silently (for messages; :func:`find_latest` warns)."""
    return next((p for p in reversed(list_checkpoints(Path(ckpt_dir))) if verify(p) is None), None)


def find_latest(ckpt_dir: Path) -> Path | None:
    """The newest checkpoint that verifies; each newer one is skipped with a one-line warning saying why."""
    for folder in reversed(list_checkpoints(Path(ckpt_dir))):
        problem = verify(folder)
        if problem is None:
            return folder
        warnings.warn(f"skipping checkpoint {folder}: {problem}", BertMPWarning, stacklevel=2)
    return None


def damaged_outputs(run_dir: Path) -> str | None:
    """Why a finished run's saved state cannot be reused as it is - its newest checkpoint or its
    export (``final/``) does not verify - or None when both do (or it has none)."""
    run_dir = Path(run_dir)
    newest = list_checkpoints(run_dir / "checkpoints")[-1:]
    if newest and (problem := verify(newest[0])):
        return f"its checkpoint {newest[0].name} does not verify ({problem})"
    final = run_dir / "final"
    if (final / CHECKSUMS).is_file() and (problem := integrity.check(final, CHECKSUMS, "").problem):
        return f"its export final/ does not verify ({problem})"
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


def read_loop_state(folder: Path) -> dict:
    """``loop_state.json`` of a checkpoint; a one-line :class:`TrainingError` when it is not a JSON object."""
    try:
        state = json.loads((Path(folder) / LOOP_STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TrainingError(
            f"checkpoint {folder}: {LOOP_STATE} is unreadable ({storage.reason(e)})"
        ) from None
    counters = (
        "step",
        "epoch",
        "batch_in_epoch",
        "data_offset",
        "skipped_steps",
        "consecutive_skips",
        "tokens_seen",
        "examples_seen",
    )
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise TrainingError(f"checkpoint {folder}: {LOOP_STATE} holds no loop state")
    bad = [
        k for k in counters if k in state and (not isinstance(state[k], int) or isinstance(state[k], bool))
    ]
    if bad:
        raise TrainingError(f"checkpoint {folder}: {LOOP_STATE}: {bad[0]} is not an integer")
    return state


def save_checkpoint(
    accelerator: Any,
    ckpt_dir: Path,
    step: int,
    loop_state: dict,
    total_limit: int,
    resume_key: str = "train.resume",
) -> Path:
    """Save atomically on every rank (collective); returns the final folder.

    A failing write (disk full, I/O error, permissions) on any rank removes the partial folder and
    raises :class:`bert_mp.errors.StorageError` on every rank; the complete checkpoints already on
    disk are left untouched.
    """
    ckpt_dir = Path(ckpt_dir)
    final = ckpt_dir / checkpoint_name(step)
    tmp = ckpt_dir / f".tmp-{checkpoint_name(step)}"
    main = accelerator.is_main_process
    failure = _attempt(lambda: _start_folder(tmp, step) if main else None)
    failure = _agree(accelerator, failure)
    entries: dict[str, dict] = {}
    if failure is None:
        failure = _agree(
            accelerator, _attempt(lambda: entries.update(state_io.write_state(accelerator, tmp)))
        )
    if failure is None and main:
        failure = _attempt(lambda: _finish_folder(tmp, final, step, loop_state, entries, total_limit))
    failure = _agree(accelerator, failure)
    if failure is not None:
        storage.remove_quietly(tmp)  # a partial checkpoint only holds space
        raise _save_failed(accelerator, ckpt_dir, final, failure, resume_key)
    return final


def _attempt(fn: Any) -> BaseException | None:
    """Run ``fn``; return the storage failure it raised (None when it succeeded)."""
    try:
        fn()
    except Exception as e:
        if storage.write_failure(e) is None:
            raise
        return e
    return None


def _agree(accelerator: Any, failure: BaseException | None) -> BaseException | None:
    """Every rank learns whether any rank failed (one all-reduce; a barrier too), so none waits forever."""
    if accelerator.num_processes == 1:
        return failure
    import torch

    flag = torch.tensor([0.0 if failure is None else 1.0], device=accelerator.device)
    if accelerator.reduce(flag, reduction="sum").item() and failure is None:
        return OSError(errno.EIO, "the checkpoint write failed on another process")
    return failure


def _start_folder(tmp: Path, step: int) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    hold("checkpoint", step, "empty")


def _finish_folder(
    tmp: Path, final: Path, step: int, loop_state: dict, entries: dict[str, dict], total_limit: int
) -> None:
    """Main process: loop state, manifest, rename into place, rotation."""
    hold("checkpoint", step, "state")
    entries[LOOP_STATE] = integrity.write_json(tmp / LOOP_STATE, loop_state)
    hold("checkpoint", step, "loop_state")
    integrity.write_manifest(tmp, MARKER, entries)  # other ranks' RNG files are hashed here
    _fsync_dir(tmp)
    hold("checkpoint", step, "marker")
    if final.exists():  # a re-run of the same step (e.g. after a resume) replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    integrity.remember(final, MARKER)
    notes.tell_launcher(notes.CHECKPOINT_NOTE, final)  # named if a rank dies later
    rotate(final.parent, total_limit)


def _save_failed(
    accelerator: Any, ckpt_dir: Path, final: Path, exc: BaseException, resume_key: str
) -> TrainingError:
    """The one line a failed save ends with: where, why, free space, size, what is intact, what to do."""
    previous = newest_verified(ckpt_dir)
    kept = (
        f"the last complete checkpoint, {previous.name}, is intact"
        if previous
        else "no complete checkpoint was saved before"
    )
    needed = storage.folder_bytes(previous) if previous else state_io.estimate_bytes(accelerator)
    return storage.storage_error(
        f"checkpoint {final.name}",
        ckpt_dir,
        exc,
        needed,
        f"{kept}. Free disk space (or lower save_total_limit) and rerun with {resume_key}=latest",
    )


def rotate(ckpt_dir: Path, total_limit: int) -> None:
    """Keep the ``total_limit`` newest complete checkpoints; drop older ones and stale temp folders."""
    complete = [p for p in list_checkpoints(ckpt_dir) if verify(p) is None]
    for old in complete[:-total_limit]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in ckpt_dir.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)


def load_checkpoint(accelerator: Any, folder: Path) -> dict:
    """Restore model/optimizer/scaler/scheduler/RNG from a verified checkpoint; returns the loop state.

    Nothing is read before the folder verifies; nothing read can execute code (:mod:`.state_codec`).
    """
    folder = Path(folder)
    problem = verify(folder)
    if problem:
        raise TrainingError(f"checkpoint {folder} is not complete: {problem}")
    verdict = integrity.check(folder, MARKER, _ABSENT)
    if not verdict.hashed:
        warnings.warn(size_only_note(folder), BertMPWarning, stacklevel=2)
    loop_state = read_loop_state(folder)
    try:
        state_io.read_state(accelerator, folder, set(verdict.files), legacy=not verdict.hashed)
    except state_io.StateFileError as e:
        raise TrainingError(f"checkpoint {folder}: {e}") from None
    return loop_state


def export_pretrained(
    accelerator: Any,
    wrapped: Any,
    tokenizer: Any,
    out_dir: Path,
    card_facts: dict | None = None,
    dtype: torch.dtype | None = None,
) -> Path | None:
    """Write ``final/``: the plain ``BertForPreTraining`` via ``save_pretrained`` (safetensors) + tokenizer,
    with the tokenizer's length limit, a model card and weight checksums (:func:`bert_mp.core.checkpoint.hf_folder.finish_hf_folder`).

    ``wrapped`` is the prepared :class:`bert_mp.model.bert.PretrainingModel`; its full state dict is
    gathered (FSDP / DeepSpeed safe) and the ``model.`` prefix stripped so keys are HF-native. A failing
    write removes the partial folder and raises :class:`bert_mp.errors.StorageError`.
    """
    from bert_mp.core.engine.sharding import full_model_state, is_sharded, without_aliases

    out_dir = Path(out_dir)
    # bert_mp's FSDP2 wrap (CPU): its own gather of the shards; engines through Accelerate: Accelerate's
    # (DeepSpeed's gathered copy unties the tied decoder weight: it is written once, as without an engine)
    if is_sharded(wrapped):
        state = full_model_state(wrapped)
    else:
        state = without_aliases(accelerator.get_state_dict(wrapped), accelerator.unwrap_model(wrapped))
    inner = accelerator.unwrap_model(wrapped).model
    if accelerator.is_main_process:
        hf_state = {k.removeprefix("model."): _as_dtype(v, dtype) for k, v in state.items()}

        def write(tmp: Path) -> None:
            inner.save_pretrained(tmp, state_dict=hf_state, safe_serialization=True)
            if dtype is not None:
                _record_dtype(tmp, dtype)
            tokenizer.save_pretrained(tmp)
            finish_hf_folder(tmp, "pretraining", inner.config.max_position_embeddings, card_facts or {})

        checkpoints = out_dir.parent / "checkpoints"
        storage.write_folder_atomically(
            out_dir,
            write,
            "the export",
            sum(t.numel() * t.element_size() for t in hf_state.values()),
            lambda: (
                f"the checkpoints in {checkpoints} are intact. Free disk space and rerun with "
                "train.resume=latest (it redoes only the final evaluation and the export)"
            ),
        )
    accelerator.wait_for_everyone()
    return out_dir


def _as_dtype(t: Any, dtype: torch.dtype | None) -> Any:
    """Floating tensors in ``dtype`` (bf16_pure exports fp32 weights by default); others as they are."""
    return t.to(dtype) if dtype is not None and torch.is_tensor(t) and t.is_floating_point() else t


def _record_dtype(folder: Path, dtype: torch.dtype) -> None:
    """config.json names the dtype the weights were written in (save_pretrained names the model's)."""
    cfg_path = Path(folder) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("dtype", "torch_dtype"):
        if key in cfg:
            cfg[key] = str(dtype).replace("torch.", "")
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
