"""A run folder has one writer, is never silently reused, and a resume never silently changes what is
trained.

Before any work, every training loop (``train`` and ``finetune``) and every sweep holds its output
folder (:func:`hold_folder`): an OS lock on ``bert-mp.lock`` inside it, taken by the main process (the
one that writes the run's shared files) and freed by the OS when that process ends however it ends;
a second command into a held folder stops with one line naming the holder. Then, for the loops:

- an output folder that already holds a run (``metrics.jsonl``, ``summary.json``, ``checkpoints/``
  or ``final/``) is an error unless the loop resumes (``<section>.resume``) or starts over on
  purpose (``<section>.overwrite_output_dir=true``, which clears the old run's files first);
- a resume compares the run's saved ``config.yaml`` with the new config: a key that changes what the
  weights are (the model's shape, the data) is refused, ``config.yaml`` untouched; any other change
  (precision, batch size, ``max_steps``, ...) is allowed, printed, and logged as a ``config_change``
  row in ``metrics.jsonl`` at the step the run resumes from;
- a pretraining resume onto prepared data rebuilt with other bytes is refused too (unless
  ``train.allow_data_change``), before any work where that data exists already: that check reads
  the prepared data, so it lives with pretraining (:mod:`bert_mp.pretrain.data_check`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bert_mp.core.process.console import is_main_process
from bert_mp.core.process.launcher import launcher_pid
from bert_mp.core.storage import disk, folder_lock
from bert_mp.errors import BertMPWarning, ConfigError

RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoints", "final")
"""What makes a folder hold a run (a folder with only config.yaml or a sweep's launch.log does not)."""
CLEARED_ON_OVERWRITE = (*RUN_FILES, "trackers", "config.yaml")

# Keys whose change makes the saved weights or optimizer state meaningless for the new run.
_SHAPE_KEYS = {
    "model": (
        "preset",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "max_position_embeddings",
        "vocab_size",
        "type_vocab_size",
        "init_from",
    ),
    "finetune": ("checkpoint", "init", "task", "train_file", "hub_name", "hub_config", "label_column"),
}
_IGNORED = ("output_dir", "resume", "overwrite_output_dir", "progress_bar", "log_with")
"""Keys that differ between launches of the same run by design."""


def holds_run(folder: Path) -> list[str]:
    """The run files in ``folder`` (empty: nothing to protect)."""
    return [name for name in RUN_FILES if (Path(folder) / name).exists()]


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): d}


_COMPARED = {"train": ("data", "model", "train", "hardware"), "finetune": ("finetune", "hardware")}
"""The config sections a loop reads: only their changes matter to a resume."""


def config_changes(old: dict, new: dict, section: str) -> dict[str, tuple[Any, Any]]:
    """``key -> (old, new)`` for every leaf of the loop's sections that differs (launch-only keys ignored;
    a key the saved config lacks, written before the key existed, is no change at its default)."""
    from bert_mp.core.config import Config, config_to_dict

    a, b, default = _flat(old), _flat(new), _flat(config_to_dict(Config()))
    return {
        k: (a.get(k), b.get(k))
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
        and k.split(".")[0] in _COMPARED[section]
        and k.split(".")[-1] not in _IGNORED
        and not (k not in a and k in default and b.get(k) == default[k])
    }


def read_summary(run_dir: Path) -> dict | None:
    """A run folder's summary.json (None when there is none or it is torn)."""
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return summary if isinstance(summary, dict) else None


def read_status(run_dir: Path) -> str | None:
    """Only the ``status`` of a run folder's summary.json (None when there is none or it is torn)."""
    return (read_summary(run_dir) or {}).get("status")


def saved_config(folder: Path) -> dict | None:
    """The config the run in ``folder`` was trained with, as a dict (None: no ``config.yaml`` there)."""
    from omegaconf import OmegaConf

    path = Path(folder) / "config.yaml"
    return OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else None


def changed_since(folder: Path, cfg: Any, section: str) -> dict[str, tuple[Any, Any]]:
    """:func:`config_changes` from the config the run in ``folder`` was trained with to ``cfg``
    (no ``config.yaml`` saved there: {})."""
    from bert_mp.core.config import config_to_dict

    saved = saved_config(folder)
    return {} if saved is None else config_changes(saved, config_to_dict(cfg), section)


def shape_changes(changes: dict[str, tuple[Any, Any]]) -> list[str]:
    """The changed keys a resume cannot take: the model's shape, the data, the fine-tuning task."""
    keys = {f"model.{k}" for k in _SHAPE_KEYS["model"]} | {f"finetune.{k}" for k in _SHAPE_KEYS["finetune"]}
    data_ok = ("data.num_proc", "data.cache_dir")  # where and how fast it is prepared, not what
    return [k for k in changes if k in keys or (k.startswith("data.") and k not in data_ok)]


def check_output_dir(cfg: Any, section: Any) -> dict[str, tuple[Any, Any]]:
    """Before any work: refuse a silent reuse of ``section.output_dir``; returns a resume's allowed changes."""
    name = section.SECTION
    out = Path(section.output_dir)
    found = holds_run(out)
    if not section.resume:
        if found and not section.overwrite_output_dir:
            raise ConfigError(
                f"{name}.output_dir={out} already holds a run ({', '.join(found)}); continue it with "
                f"{name}.resume=latest, or start over with {name}.overwrite_output_dir=true"
            )
        return {}
    changes = changed_since(out, cfg, name)
    refused = shape_changes(changes)
    if refused:
        shown = "; ".join(f"{k}: {changes[k][0]!r} -> {changes[k][1]!r}" for k in refused[:3])
        raise ConfigError(
            f"{name}.resume: the run in {out} was trained with other weights or data ({shown}); "
            f"resume with its config ({out / 'config.yaml'}), or start a new run in another {name}.output_dir"
        )
    return changes


def clear_run(folder: Path) -> None:
    """``overwrite_output_dir``: remove an old run's files so nothing of it mixes with the new one."""
    for name in CLEARED_ON_OVERWRITE:
        path = Path(folder) / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def describe_changes(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())


def announce_resume(accelerator: Any, command: str, folder: str | None, step: int, changes: dict) -> None:
    """One console line for a resume (and one for its config changes), on the main process."""
    if folder is None or not accelerator.is_main_process:
        return
    print(f"bert-mp {command}: resuming from step {step} (checkpoint {folder})", flush=True)
    if changes:
        print(
            f"bert-mp {command}: config changed since the checkpoint: {describe_changes(changes)}", flush=True
        )


# --------------------------------------------------------------------------------------------------
# one writer per folder
# --------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def hold_folder(
    folder: str | Path, key: str, what: str = "run", check: Callable[[], None] = lambda: None
) -> Iterator[None]:
    """Hold ``folder`` (the value of config key ``key``) for this command, on the main process only.

    A folder a live process holds is refused in one line naming it (:class:`ConfigError`, exit 2); a
    file system that cannot lock is said once, and the command goes on unlocked. ``check`` (the run
    folder's refusals, which only read) runs under the lock - or, where the folder has no lock file
    yet, before it is created, so that a refused command leaves the folder as it found it. Costs a
    few system calls at the start, nothing per step.
    """
    if not is_main_process():  # under a launch, rank 0 writes the run's shared files and holds it
        check()
        yield
        return
    checked = not (Path(folder) / folder_lock.LOCK_FILE).exists()
    if checked:
        check()
    lock = _take(folder, key, what)
    with lock:
        if not checked:
            check()
        yield


def _take(folder: str | Path, key: str, what: str) -> folder_lock.FolderLock:
    try:
        lock = folder_lock.take(folder, folder_lock.me(launcher_pid()))
    except folder_lock.FolderInUse as e:
        raise ConfigError(busy_line(folder, key, e.holder, what)) from None
    except OSError as e:
        if disk.write_failure(e) is None:  # not a folder (a file of that name), a name too long, ...
            raise ConfigError(f"{key}={folder}: cannot hold it as a run folder ({disk.reason(e)})") from None
        raise disk.storage_error(
            f"the lock file {folder_lock.LOCK_FILE}", folder, e, None, f"choose a writable {key}"
        ) from None
    if lock.problem:
        warnings.warn(
            f"{key}={folder}: this file system cannot lock files ({lock.problem}); a second command "
            "writing to this folder at the same time would not be refused",
            BertMPWarning,
            stacklevel=4,
        )
    return lock


def busy_line(folder: str | Path, key: str, holder: folder_lock.Holder | None, what: str = "run") -> str:
    """The refusal of a held folder: who holds it, and what to do."""
    if holder is None:
        return (
            f"{key}={folder} is in use by another {what} (its lock file {folder_lock.LOCK_FILE} names "
            f"no holder); wait for it to end, or choose another {key}"
        )
    return (
        f"{key}={folder} is in use by another {what}: {holder.describe()}; wait for it to end or stop it "
        f"(kill -TERM {holder.stop_pid} on {holder.host}), or choose another {key}"
    )


def hold_run_folder(section: Any, check: Callable[[], None]) -> contextlib.AbstractContextManager[None]:
    """:func:`hold_folder` for a training loop's section (``train`` / ``finetune``), ``check`` its run
    guard (:func:`check_output_dir`, or pretraining's)."""
    return hold_folder(section.output_dir, f"{section.SECTION}.output_dir", check=check)
