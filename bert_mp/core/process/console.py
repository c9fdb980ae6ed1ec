"""What a user sees of a running command: ``bert-mp <command>: ...`` lines, from the main process only.

Under ``accelerate launch`` every process runs the same code; a line every process printed would
appear once per process (``bert-mp prepare: reusing ...`` twice with two processes). :func:`say`
prints on the main process only and names the command the user ran (``train`` even where the
line comes from the data preparation that ``bert-mp train`` runs first).
"""

from __future__ import annotations

import io
import os
import sys
from typing import TextIO

from bert_mp.core.process import notes

_COMMAND = ["bert-mp"]


def set_command(name: str) -> None:
    """The subcommand being run (the CLI calls this first)."""
    _COMMAND[0] = name


def command(default: str = "bert-mp") -> str:
    """The subcommand being run, or ``default`` outside the CLI (a test calling a function)."""
    return default if _COMMAND[0] == "bert-mp" else _COMMAND[0]


def speaker(default: str = "bert-mp") -> str:
    """``bert-mp <command>``: the prefix of the running command's lines."""
    name = command(default)
    return "bert-mp" if name == "bert-mp" else f"bert-mp {name}"


def is_main_process() -> bool:
    """Rank 0, or no launcher at all; readable before any process group exists."""
    return all(os.environ.get(var, "0") == "0" for var in notes.RANK_VARS)


def say(text: str, *, command: str | None = None, file: TextIO | None = None) -> None:
    """``bert-mp <command>: <text>`` on the main process (stdout, flushed); ``command`` defaults to
    the running one."""
    prefix = f"bert-mp {command}" if command else speaker()
    show(f"{prefix}: {text}", file=file)


def show(line: str, *, file: TextIO | None = None) -> None:
    """A whole line (already prefixed, or a continuation line) on the main process only."""
    if is_main_process():
        print(line, file=file or sys.stdout, flush=True)


def error(line: str, exit_code: int) -> None:
    """A command's one error line. Under ``bert-mp launch``: left for the launcher
    (:data:`~bert_mp.core.process.notes.LAUNCH_ERRORS_ENV`); otherwise on stderr in one write, so the lines of several ranks
    (a plain ``accelerate launch``) never run together."""
    if notes.leave_exit(line, exit_code):
        return
    data = line + "\n"
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):  # a captured stream (tests)
        sys.stderr.write(data)
        sys.stderr.flush()
        return
    sys.stderr.flush()
    os.write(fd, data.encode("utf-8", errors="replace"))


def ended(exit_code: int) -> None:
    """Under ``bert-mp launch``: a rank's run ended with ``exit_code`` (not 0) and printed what it had
    to say; the launcher exits with that code instead of showing torch elastic's report of it."""
    if exit_code:
        notes.leave_exit(None, exit_code)
