"""What a user sees of a running command: ``bert-mp <command>: ...`` lines, from the main process only.

Under ``accelerate launch`` every process runs the same code; a line every process printed would
appear once per process (``bert-mp prepare: reusing ...`` twice with two processes). :func:`say`
prints on the main process only and names the command the user ran (``train`` even where the
line comes from the data preparation that ``bert-mp train`` runs first).
"""

from __future__ import annotations

import os
import sys
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
