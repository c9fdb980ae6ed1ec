"""What a training run writes besides checkpoints: config.yaml, metrics.jsonl, summary.json,
Accelerate trackers and the progress bar. Only the main process writes files; a write the disk
refuses ends the run with one line (:class:`bert_mp.errors.StorageError`), not a traceback."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bert_mp.core.config import config_to_dict, save_config
from bert_mp.core.loop.callbacks import finite_or_none
from bert_mp.core.process.run_dir import clear_run
from bert_mp.core.storage.files import JsonlWriter, atomic_write_json, read_jsonl
from bert_mp.errors import BertMPError, BertMPWarning


def clean(logs: dict) -> dict:
    """A log row with non-finite floats as None (JSON has no NaN)."""
    return {k: finite_or_none(v) for k, v in logs.items()}


def _flat_scalars(d: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat_scalars(v, key + "."))
        elif isinstance(v, (int, float, str, bool)):
            out[key] = v
        else:
            out[key] = str(v)
    return out


class RunLog:
    """The output folder of one run (``cfg.<section>.output_dir``) as the loop writes it."""

    def __init__(self, accelerator: Any, cfg: Any, section: Any, log_with: list[str] = ()):
        self.accelerator = accelerator
        self.cfg, self.section = cfg, section
        self.out = Path(section.output_dir)
        self.main = accelerator.is_main_process
        self.log_with = list(log_with)
        self.writer: JsonlWriter | None = None
        self.bar: Any = None

    def write_config(self) -> None:
        """config.yaml: the resolved config, after the restore and before any step, so a refused
        resume leaves the old one (an old run is cleared first when the section says
        ``overwrite_output_dir``; :func:`bert_mp.core.process.run_dir.check_output_dir` has refused every
        other reuse of the folder)."""
        if self.main:
            if self.section.overwrite_output_dir and not self.section.resume:
                clear_run(self.out)
            with self.refused("config.yaml"):
                self.out.mkdir(parents=True, exist_ok=True)
                save_config(self.cfg, self.out / "config.yaml")
        self.accelerator.wait_for_everyone()

    @contextlib.contextmanager
    def refused(self, what: str) -> Iterator[None]:
        """A write the storage refuses becomes one line naming the run's last complete checkpoint."""
        from bert_mp.core.checkpoint import store as checkpoint
        from bert_mp.core.storage import disk as storage

        try:
            yield
        except OSError as e:
            if storage.write_failure(e) is None:
                raise
            newest = checkpoint.newest_verified(self.out / "checkpoints")
            kept = (
                f"the last complete checkpoint, {newest.name}, is intact"
                if newest
                else "no checkpoint was saved"
            )
            raise storage.storage_error(
                what,
                self.out,
                e,
                None,
                f"{kept}. Free disk space and rerun with {self.section.SECTION}.resume=latest",
            ) from None

    def open(
        self, resumed_step: int | None, rerun_eval_step: int | None = None, changes: dict | None = None
    ) -> None:
        """Start metrics.jsonl, trackers and the progress bar.

        A resumed run keeps the rows up to its step, except an evaluation at ``rerun_eval_step``
        (the final one, which a resume from the last checkpoint runs and logs again). A checkpoint
        copied without its metrics.jsonl resumes with a log that starts there. ``changes`` (a
        resume's allowed config changes, ``key -> (old, new)``) become a ``config_change`` row.
        """
        if self.main:
            path = self.out / "metrics.jsonl"
            kept = []
            if resumed_step is not None and path.exists():
                kept = [
                    r
                    for r in read_jsonl(path)
                    if r.get("step", 0) <= resumed_step
                    and not (r.get("kind") == "eval" and r.get("step") == rerun_eval_step)
                ]
            with self.refused("metrics.jsonl"):
                self.writer = JsonlWriter(path)
                for r in kept:
                    self.writer.write(r)
                if resumed_step is not None and changes:
                    row = {k: {"old": a, "new": b} for k, (a, b) in changes.items()}
                    self.writer.write({"step": resumed_step, "kind": "config_change", "changes": row})
        if self.log_with:
            self.accelerator.init_trackers("bert_mp", config=_flat_scalars(config_to_dict(self.cfg)))

    def start_bar(self, total: int, initial: int, desc: str) -> None:
        if self.main and self.section.progress_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)

    def write(self, row: dict) -> None:
        """One metrics.jsonl row (every step and evaluation)."""
        if self.writer:
            with self.refused("metrics.jsonl"):
                self.writer.write(clean(row))

    def track(self, logs: dict, step: int) -> None:
        """Float metrics to the experiment trackers."""
        if self.log_with:
            self.accelerator.log({k: v for k, v in logs.items() if isinstance(v, float)}, step=step)

    def progress(self, advance: int = 1, **postfix: str) -> None:
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(refresh=False, **postfix)
            self.bar.update(advance)

    def say(self, line: str) -> None:
        """One console line on the main process, above the progress bar when there is one."""
        if not self.main:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def finish(self, summary: dict) -> None:
        """summary.json, then close the log and the trackers."""
        self.close_bar()
        if self.main:
            try:
                with self.refused("summary.json"):
                    atomic_write_json(self.out / "summary.json", clean(summary))
            except BertMPError as e:
                if summary.get("status") != "failed":
                    raise
                # the run is failing already (often for the same full disk): its error is the one to see
                warnings.warn(str(e), BertMPWarning, stacklevel=2)
        if self.writer:
            with contextlib.suppress(OSError):  # flushed line by line: nothing is pending
                self.writer.close()
            self.writer = None
        if self.log_with:
            self.accelerator.end_training()
