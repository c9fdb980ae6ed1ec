"""What a user sees of a running command: ``bert-mp <command>: ...`` lines, from the main process only.

Under ``accelerate launch`` every process runs the same code; a line every process printed would
appear once per process (``bert-mp prepare: reusing ...`` twice with two processes). :func:`say`
prints on the main process only and names the command the user ran (``train`` even where the
line comes from the data preparation that ``bert-mp train`` runs first).
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path
from typing import TextIO

_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")
"""Where launchers put a process's global rank (torchrun / accelerate, Open MPI, MPICH, MVAPICH)."""
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
    return all(os.environ.get(var, "0") == "0" for var in _RANK_VARS)


def say(text: str, *, command: str | None = None, file: TextIO | None = None) -> None:
    """``bert-mp <command>: <text>`` on the main process (stdout, flushed); ``command`` defaults to
    the running one."""
    prefix = f"bert-mp {command}" if command else speaker()
    show(f"{prefix}: {text}", file=file)


def show(line: str, *, file: TextIO | None = None) -> None:
    """A whole line (already prefixed, or a continuation line) on the main process only."""
    if is_main_process():
        print(line, file=file or sys.stdout, flush=True)


LAUNCH_ERRORS_ENV = "BERT_MP_LAUNCH_ERRORS"
"""Set by ``bert-mp launch`` for the processes it starts: a folder where a rank leaves its error line
instead of printing it, so the launcher prints one rank's line, once, and exits with its code."""


def error(line: str, exit_code: int) -> None:
    """A command's one error line. Under ``bert-mp launch``: left for the launcher
    (:data:`LAUNCH_ERRORS_ENV`); otherwise on stderr in one write, so the lines of several ranks
    (a plain ``accelerate launch``) never run together."""
    folder = os.environ.get(LAUNCH_ERRORS_ENV)
    if folder and Path(folder).is_dir():
        rank = next((os.environ[v] for v in _RANK_VARS if os.environ.get(v, "").isdigit()), "0")
        path = Path(folder) / f"rank-{int(rank):06d}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"line": line, "exit_code": exit_code}), encoding="utf-8")
        tmp.replace(path)  # the launcher reads it whole or not at all
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


def launch_errors(folder: str | Path) -> list[tuple[str, int]]:
    """The error lines the ranks left in ``folder`` (see :func:`error`), lowest rank first."""
    out = []
    for path in sorted(Path(folder).glob("rank-*.json")):
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
            out.append((str(d["line"]), int(d["exit_code"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out
