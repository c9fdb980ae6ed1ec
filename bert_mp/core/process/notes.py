"""The files between the ranks of ``bert-mp launch`` and their launcher, and a rank's stderr under it.

``bert-mp launch`` gives its processes a folder (:data:`LAUNCH_ERRORS_ENV`): a rank leaves its one
error line and exit code there (:mod:`.console` writes them), and the run leaves notes (the run
folder, the last checkpoint) that the launcher reads when it reports how the launch ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import TextIO

RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")
"""Where launchers put a process's global rank (torchrun / accelerate, Open MPI, MPICH, MVAPICH)."""

LAUNCH_ERRORS_ENV = "BERT_MP_LAUNCH_ERRORS"
"""Set by ``bert-mp launch`` for the processes it starts: a folder where a rank leaves its error line
instead of printing it (so the launcher prints one rank's line, once, and exits with its code), the
exit code of a run that ended otherwise than completed, and the run folder once the run holds it."""


def launch_folder() -> Path | None:
    folder = os.environ.get(LAUNCH_ERRORS_ENV)
    return Path(folder) if folder and Path(folder).is_dir() else None


def leave(name: str, text: str) -> None:
    """A file for the launcher, whole or not at all."""
    path = launch_folder() / name  # type: ignore[operator]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def rank_file() -> str:
    rank = next((os.environ[v] for v in RANK_VARS if os.environ.get(v, "").isdigit()), "0")
    return f"rank-{int(rank):06d}.json"


def leave_exit(line: str | None, exit_code: int) -> bool:
    """Under ``bert-mp launch``: leave this rank's error line (None: it printed its own) and exit code
    for the launcher (:func:`launch_errors` reads them); False where there is no launcher to tell."""
    if launch_folder() is None:
        return False
    leave(rank_file(), json.dumps({"line": line, "exit_code": exit_code}))
    return True


RUN_FOLDER_NOTE, CHECKPOINT_NOTE = "run_folder", "last_checkpoint"
"""Notes a run leaves in :data:`LAUNCH_ERRORS_ENV` for its launcher: the run folder, once the run
holds it (the launcher keeps its log there), and the last checkpoint the run completed."""


def tell_launcher(note: str, text: str | Path) -> None:
    """Under ``bert-mp launch``: leave ``note`` for the launcher (the first process of each machine)."""
    if launch_folder() is not None and os.environ.get("LOCAL_RANK", "0") == "0":
        leave(note, str(text))


def tell_launcher_the_run_folder(output_dir: str | Path) -> None:
    """Once the run holds its folder (see :data:`RUN_FOLDER_NOTE`)."""
    tell_launcher(RUN_FOLDER_NOTE, Path(output_dir).absolute())


def launcher_note(folder: str | Path, note: str) -> str | None:
    """A note a run left in ``folder`` (:func:`tell_launcher`), or None."""
    try:
        return (Path(folder) / note).read_text(encoding="utf-8") or None
    except OSError:
        return None


def launch_errors(folder: str | Path) -> list[tuple[str | None, int]]:
    """What the ranks left in ``folder``, lowest rank first: each one's error line and exit code
    (:func:`error`), or its exit code alone (:func:`ended`: its run printed its own last line)."""
    out: list[tuple[str | None, int]] = []
    for path in sorted(Path(folder).glob("rank-*.json")):
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
            out.append((None if d["line"] is None else str(d["line"]), int(d["exit_code"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


class LauncherStream:
    """``sys.stderr`` of a rank under ``bert-mp launch``. Its stderr is a pipe to the launcher; once the
    launcher is gone (killed), a write to it raises ``BrokenPipeError`` - a progress bar's update
    would then end the rank in the middle of the step it should finish and save. Here such a write
    sends file descriptor 2 to ``/dev/null`` instead (for the C++ libraries too) and is dropped."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, self._stream.fileno())
        finally:
            os.close(null)
        with contextlib.suppress(OSError, ValueError):
            self._stream.flush()  # what was buffered goes to /dev/null now

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def guard_stderr_under_launch() -> None:
    """Under ``bert-mp launch`` (:data:`LAUNCH_ERRORS_ENV` set), wrap ``sys.stderr`` in
    :class:`LauncherStream` (first thing: loggers and progress bars made later write through it)."""
    if os.environ.get(LAUNCH_ERRORS_ENV) and not isinstance(sys.stderr, LauncherStream):
        sys.stderr = LauncherStream(sys.stderr)  # type: ignore[assignment]
