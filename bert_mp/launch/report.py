"""What ``bert-mp launch`` says when a rank dies, and where it keeps everything else.

When a rank dies (SIGKILL - the out-of-memory killer's signal -, a segfault, an abort), torch elastic's
agent ends the other ranks (each with a collective's traceback: ``Connection reset by peer``) and the
``accelerate launch`` process exits 1 with its own traceback and a table of the failed ranks. The
launcher turns that into one line (:func:`rank_death_line`): which rank, which signal or exit code,
after which step (the last one logged), the last checkpoint saved and the command that continues the
run, exit :data:`RANK_DIED_EXIT_CODE`. All that the ranks and the launcher wrote on stderr is kept in
the run folder's ``launch.log`` (:class:`LaunchLog`); :class:`LauncherLines` decides what is shown.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

RANK_DIED_EXIT_CODE = 5
"""``bert-mp launch``'s exit code when a rank died (killed by a signal, or ended by an error that is
not a mistake in the input): distinct from 2 (input), 3 (stopped), 4 (storage) and 130 / 143 (signals)."""

_BLOCK = re.compile(r"^\[\d+\]:\s*$")
_FIELD = re.compile(r"^\s+(time|host|rank|exitcode|error_file|traceback)\s*:\s*(.*)$")
_RANK = re.compile(r"^(\d+)\s*\(local_rank:\s*(\d+)\)")
_EXIT = re.compile(r"^(-?\d+)\s*\(pid:\s*(\d+)\)")


@dataclass(frozen=True)
class RankFailure:
    """One row of torch elastic's table of failed ranks."""

    rank: int
    exitcode: int
    pid: int
    host: str
    root: bool
    """Torch elastic's "first observed failure" (not always the cause: see :func:`culprit`)."""

    @property
    def signal_name(self) -> str | None:
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    def how(self) -> str:
        name = self.signal_name
        if name == "SIGKILL":
            return "was killed by SIGKILL (the out-of-memory killer's signal, among others)"
        return f"was killed by {name}" if name else f"ended with exit code {self.exitcode}"


def parse_failures(text: str) -> list[RankFailure]:
    """The failed ranks in torch elastic's ``ChildFailedError`` table (empty: no such table)."""
    out: list[RankFailure] = []
    fields: dict[str, str] = {}
    root = in_root = False

    def close() -> None:
        r, e = _RANK.match(fields.get("rank", "")), _EXIT.match(fields.get("exitcode", ""))
        if r and e:
            out.append(
                RankFailure(int(r.group(1)), int(e.group(1)), int(e.group(2)), fields.get("host", "?"), root)
            )

    for line in text.splitlines():
        if line.startswith("Root Cause"):
            in_root = True
        if _BLOCK.match(line):
            close()
            fields, root = {}, in_root
        elif found := _FIELD.match(line):
            fields[found.group(1)] = found.group(2).strip()
    close()
    return out


_CLOSING = {-signal.SIGTERM, -signal.SIGINT}
"""How torch elastic ends the ranks that outlived a failed one: not the cause of anything."""


def culprit(failures: Sequence[RankFailure]) -> RankFailure:
    """The rank that died first: one killed by a signal the agent does not send (SIGKILL, SIGSEGV, ...),
    else one that ended with an exit code of its own, else one that ended with an error (exit 1:
    also what the survivors' collective errors give), else torch elastic's root cause."""

    def order(f: RankFailure) -> tuple[int, bool, int]:
        if f.exitcode < 0 and f.exitcode not in _CLOSING:
            kind = 0
        elif f.exitcode not in (1, *_CLOSING):
            kind = 1
        else:
            kind = 2 if f.exitcode == 1 else 3
        return (kind, not f.root, f.rank)

    return min(failures, key=order)


def last_logged_step(run_dir: Path) -> int | None:
    """The last training step in ``metrics.jsonl`` (read from its end), or None."""
    try:
        with open(run_dir / "metrics.jsonl", "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("kind") == "train" and isinstance(row.get("step"), int):
            return row["step"]
    return None


def continue_command(argv: Sequence[str], command: str) -> str:
    """``bert-mp launch ARGV`` that continues the run: ``<command>.resume=latest`` (any resume or
    overwrite the launch gave is dropped)."""
    at = list(argv).index(command)
    args = [
        a
        for a in argv[at + 1 :]
        if not a.startswith((f"{command}.resume=", f"{command}.overwrite_output_dir="))
    ]
    return shlex.join(["bert-mp", "launch", *argv[: at + 1], *args, f"{command}.resume=latest"])


def rank_death_line(
    failure: RankFailure, run_dir: str | None, checkpoint: str | None, resume: str | None, log: Path | None
) -> str:
    """``rank R (pid P on H) was killed by SIGKILL after step N ...``: what, when, how to continue."""
    line = f"rank {failure.rank} (pid {failure.pid} on {failure.host}) {failure.how()}"
    step = last_logged_step(Path(run_dir)) if run_dir else None
    line += f" after step {step} (the last one logged)" if step is not None else " before its first step"
    line += "; torch elastic ended the other ranks"
    again = f"`{resume}`" if resume else "the same launch and <command>.resume=latest"
    line += (
        f"; the last checkpoint saved is {checkpoint}; continue the run with {again}"
        if checkpoint
        else f"; no checkpoint was saved; start it again with {again}"
    )
    return line + (f"; what the ranks and the launcher wrote: {log}" if log else "")


_FAILING = re.compile(
    r"^(\[rank\d+\]:\s*)?Traceback \(most recent call last\)|closing signal SIG|failed \(exitcode: "
)
"""Lines that start the report of a failing rank or launcher."""
_ENGINE_DUMP = re.compile(
    r"^(\[[EWI]\d{4} [\d:.]+ \S+\] |Exception raised from |frame #\d+: |<omitting python frames>|\s*$)"
)
"""torch's C++ log lines and the stack dumps under them (a rendezvous client retrying to connect)."""


class LauncherLines:
    """Sorts what the launcher writes on stderr: shown as it comes, or held (judged once the launch
    has ended: shown, or kept in the log only, where the launch ends in one line of its own).

    Held: everything after the start of a failure's report (a traceback, torch elastic ending the
    ranks) or after the launch began to end (a signal, a rank's own line or exit code). torch's C++
    log lines and stack dumps wait for the next line: held with a failure that follows, shown
    before anything else (a rendezvous client that connected after a retry)."""

    def __init__(self) -> None:
        self.held: list[str] = []
        self._waiting: list[str] = []

    def take(self, line: str, ending: bool = False) -> list[str]:
        """The lines to show now, ``line`` being the next one (``ending``: the launch began to end)."""
        if line.startswith("bert-mp "):  # the ranks' own lines: always, at once
            return [line]
        if self.held or ending or _FAILING.search(line):
            self.held += [*self._waiting, line]
            self._waiting = []
            return []
        if _ENGINE_DUMP.match(line):
            self._waiting.append(line)
            return []
        shown, self._waiting = [*self._waiting, line], []
        return shown

    def rest(self) -> list[str]:
        """What is left once the launch has ended: held lines, then any still waiting."""
        return [*self.held, *self._waiting]


class LaunchLog:
    """Everything the launcher and the ranks write on stderr: held in memory until the run names its
    folder (:func:`bert_mp.core.process.notes.tell_launcher_the_run_folder`: the run holds it by then),
    then appended to ``<folder>/<name>`` line by line, so it is there even if the launcher is killed."""

    def __init__(self, argv: Sequence[str], name: str = "launch.log") -> None:
        when = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        self.name, self.path = name, None
        self._pending = [f"$ {shlex.join(['bert-mp', 'launch', *argv])}  # {when}, pid {os.getpid()}\n"]
        self._file: TextIO | None = None

    def write(self, line: str) -> None:
        if self._file is None:
            self._pending.append(line)
            return
        self._file.write(line)
        self._file.flush()  # in the kernel's hands at once: a SIGKILL of the launcher loses nothing

    def attach(self, folder: Path) -> None:
        """Continue the log in ``folder`` (once)."""
        if self._file is not None:
            return
        try:
            self._file = open(Path(folder) / self.name, "a", encoding="utf-8")  # noqa: SIM115 (closed in close)
        except OSError:
            return  # kept in memory: :meth:`keep` writes it elsewhere
        self.path = Path(folder) / self.name
        self._file.writelines(self._pending)
        self._file.flush()
        self._pending.clear()

    def keep(self) -> Path:
        """Where the log is: its run folder's file, or (never attached) a temporary file written now."""
        if self.path is not None:
            return self.path
        fd, name = tempfile.mkstemp(prefix="bert-mp-launch-", suffix=".log")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(self._pending)
        self.path = Path(name)
        return self.path

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
