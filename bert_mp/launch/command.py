"""``bert-mp launch``: ``accelerate launch`` for ``train`` / ``finetune``, with a signal's exit code,
a rank's mistake or death as one line (:mod:`.report`) and several machines' meeting (:mod:`.machines`).

The ``accelerate launch`` command line itself and the environment the ranks see are shared with
``bert-mp sweep`` (:mod:`bert_mp.core.process.spawn`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bert_mp.core.process.spawn import accelerate_launch, launcher_env, pop_num_processes
from bert_mp.launch.machines import (
    JOIN_TIMEOUT_S,
    Machines,
    join_failure,
    machines_of,
    pop_join_timeout,
    rendezvous_options,
)
from bert_mp.launch.report import (
    RANK_DIED_EXIT_CODE,
    LauncherLines,
    LaunchLog,
    continue_command,
    culprit,
    parse_failures,
    rank_death_line,
)

# --------------------------------------------------------------------------------------------------
# bert-mp launch: accelerate launch, with a signal's exit code and one line
# --------------------------------------------------------------------------------------------------
LAUNCHABLE = ("train", "finetune")
_LAUNCHER_REPORTS = ("SignalException", "ChildFailedError", "CalledProcessError")
"""What the launcher raises, with a traceback, after it passed on a signal (torch elastic's
``SignalException``) or when a rank ended with an error (torch elastic's ``ChildFailedError``,
Accelerate's one-process launcher's ``CalledProcessError``)."""


def split_launch_args(argv: Sequence[str]) -> tuple[list[str], str, list[str]]:
    """``[accelerate launch options] COMMAND [its arguments]`` -> (options, command, arguments)."""
    from bert_mp.errors import ConfigError

    for i, arg in enumerate(argv):
        if arg in LAUNCHABLE:
            return list(argv[:i]), arg, list(argv[i + 1 :])
    raise ConfigError(
        "name the command to launch after the accelerate launch options, e.g. "
        "`bert-mp launch --num_processes 2 train CONFIG.yaml` (one of: " + ", ".join(LAUNCHABLE) + ")"
    )


def launch_argv(options: Sequence[str], command: str, args: Sequence[str], *, cuda: bool) -> list[str]:
    """The ``accelerate launch`` command line that runs ``bert-mp COMMAND ARGS`` on every process; a
    ``--num_processes N`` on a machine without CUDA starts N CPU processes (:func:`accelerate_launch`)."""
    n, rest = pop_num_processes(list(options))
    base = (
        accelerate_launch(n, cuda=cuda, extra=rest)
        if n is not None
        else [sys.executable, "-m", "accelerate.commands.launch", *rest]
    )
    return [*base, "-m", "bert_mp", command, *args]


@dataclass
class LaunchContext:
    """What ``bert-mp launch`` knows beyond the launcher's command line: its own arguments (for the
    log and the command that continues a run), the command launched, and its machines."""

    argv: Sequence[str] = ()
    command: str = "train"
    machines: Machines | None = None
    join_timeout: float = JOIN_TIMEOUT_S

    @property
    def log_name(self) -> str:
        return "launch.log" if self.machines is None else f"launch-machine{self.machines.rank}.log"


def run_launcher(argv: Sequence[str], context: LaunchContext | None = None) -> int:
    """Run ``argv`` (an ``accelerate launch``) in its own process group and pass it every SIGINT or
    SIGTERM this process gets, once. After a signal the ranks save and stop, each printing as a plain
    ``bert-mp train`` would (the main rank's line), and this returns 128 + signal. A rank that ends
    with a mistake in the input leaves its one line for this process (``console.error``): the lowest
    rank's line is printed once and its exit code returned (2, or 4 for a refused write); a run that
    stopped leaves its exit code (``console.ended``). A rank that died (a signal, a crash) is one line
    (:mod:`.report`), exit :data:`RANK_DIED_EXIT_CODE`; machines that did not meet are one line,
    exit 2. The launcher's own report of what happened (a traceback, exit 1) is dropped then; anything
    else the launcher or a rank wrote on stderr meanwhile is shown. All of it is kept in the run
    folder's ``launch.log``."""
    import contextlib
    import os
    import signal
    import subprocess
    import tempfile

    from bert_mp.core.process import notes

    ctx = context or LaunchContext()
    log = LaunchLog(ctx.argv, ctx.log_name)
    with tempfile.TemporaryDirectory(prefix="bert-mp-launch-") as errors:
        env = {**launcher_env(os.environ), notes.LAUNCH_ERRORS_ENV: errors}
        # its own group: a terminal's Ctrl-C reaches this process only, which passes it on exactly once
        proc = subprocess.Popen(list(argv), stderr=subprocess.PIPE, text=True, process_group=0, env=env)
        caught: list[int] = []

        def forward(signum: int, frame: object) -> None:
            caught.append(signum)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signum)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        lines = LauncherLines()
        try:
            for line in proc.stderr:  # type: ignore[union-attr]
                log.write(line)
                if log.path is None and (folder := notes.launcher_note(errors, notes.RUN_FOLDER_NOTE)):
                    log.attach(Path(folder))
                ending = bool(caught) or any(Path(errors).glob("rank-*.json"))
                sys.stderr.writelines(lines.take(line, ending))
                sys.stderr.flush()
            code = proc.wait()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            log.close()
        reported = notes.launch_errors(errors)
        checkpoint = notes.launcher_note(errors, notes.CHECKPOINT_NOTE)
    return _outcome(code, caught, reported, lines.rest(), ctx, log, checkpoint)


def _outcome(
    code: int,
    caught: list[int],
    reported: list[tuple[str | None, int]],
    held: list[str],
    ctx: LaunchContext,
    log: LaunchLog,
    checkpoint: str | None,
) -> int:
    """What the launch says and returns once its launcher has ended (see :func:`run_launcher`)."""
    text = "".join(held)
    launcher_report = any(report in text for report in _LAUNCHER_REPORTS)
    if code != 0 and (caught or reported) and launcher_report:
        held = []  # the launcher's report of a signal or of the ranks' own lines: in the log only
    if code == 0 or caught:
        sys.stderr.writelines(held)
        return 128 + caught[0] if caught and code != 0 else code
    if reported:
        sys.stderr.writelines(held)
        line, rank_code = next(((ln, c) for ln, c in reported if ln is not None), reported[0])
        if line is not None:
            _say(line)
        return rank_code
    if failures := parse_failures(text):
        resume = continue_command(ctx.argv, ctx.command) if ctx.command in ctx.argv else None
        run_dir = str(log.path.parent) if log.path is not None else None
        line = rank_death_line(culprit(failures), run_dir, checkpoint, resume, log.keep())
        _say(f"bert-mp launch: error: {line}")
        return RANK_DIED_EXIT_CODE
    if ctx.machines is not None and (line := join_failure(text, ctx.machines, ctx.join_timeout)):
        _say(f"bert-mp launch: error: {line}")
        return 2
    sys.stderr.writelines(held)
    return code


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def command(argv: Sequence[str]) -> int:
    """``bert-mp launch [accelerate launch options] train|finetune [CONFIG] [key=value ...]``."""
    if not argv or argv[0] in ("-h", "--help"):
        print(LAUNCH_HELP)
        return 0
    options, cmd, args = split_launch_args(argv)
    join_timeout, options = pop_join_timeout(options)
    machines = machines_of(options)
    if machines is not None:  # the engine's rendezvous, with --join_timeout as its timeout
        options = rendezvous_options(options, join_timeout)
    context = LaunchContext(list(argv), cmd, machines, join_timeout)
    return run_launcher(launch_argv(options, cmd, args, cuda=cuda_available()), context)


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, without importing torch (~2 CPU seconds) where the answer is
    certain: False when the installed torch is built without CUDA or ROCm (its ``torch/version.py``,
    read alone). With a GPU build, torch is asked."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    locations = list(spec.submodule_search_locations or []) if spec else []
    if locations:
        path = Path(locations[0]) / "version.py"
        try:
            version_spec = importlib.util.spec_from_file_location("_bert_mp_torch_version", path)
            build = importlib.util.module_from_spec(version_spec)
            version_spec.loader.exec_module(build)
            if getattr(build, "cuda", None) is None and getattr(build, "hip", None) is None:
                return False
        except (OSError, SyntaxError, AttributeError):
            pass  # another layout: ask torch
    import torch

    return torch.cuda.is_available()


LAUNCH_HELP = """usage: bert-mp launch [ACCELERATE LAUNCH OPTIONS] {train,finetune} [CONFIG.yaml] [key=value ...]

Runs `accelerate launch ... -m bert_mp COMMAND ...`. Without CUDA, `--num_processes N` starts N CPU
processes (gloo); a plain `accelerate launch --cpu --num_processes N` starts one. Ctrl-C or SIGTERM
is passed to the launcher once; the ranks finish their step, save a checkpoint and stop, and this
exits 130 / 143 with the run's one stopped line (not torch elastic's traceback and exit 1). A rank
that dies (SIGKILL, a segfault) ends the launch with one line naming it, the last checkpoint and the
command that continues the run, exit 5; the ranks' and the launcher's stderr is in the run folder's
launch.log. If this process is killed, the ranks finish their step, save and stop (`launcher gone`).
With --num_machines N the machines meet in torch elastic's rendezvous: one that has not come within
--join_timeout SECONDS (default 300) ends the others with one line, exit 2."""
