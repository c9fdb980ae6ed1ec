"""The ``accelerate launch`` command line for N processes on this machine, shared by ``bert-mp
sweep``, the scale-out benchmark and the multi-process tests.

Accelerate 1.x starts ONE process for ``--cpu --num_processes N`` (unless an MPI hostfile is
given); torchrun-style spawning (``--multi_gpu``) starts N, and bert_mp puts each on the CPU with
gloo when there is no CUDA. So without CUDA, N > 1 processes are launched with ``--multi_gpu``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path


def accelerate_launch(
    num_processes: int, *, cuda: bool, extra: Sequence[str] = (), port: int | None = None
) -> list[str]:
    """``python -m accelerate.commands.launch`` with ``num_processes`` local processes; the program
    and its arguments follow. ``extra``: further launch arguments, which win (a ``--config_file``
    supplies the machine, precision and dynamo settings itself); ``port``: ``--main_process_port``
    (distinct ports let concurrent launches on one machine coexist)."""
    extra = list(extra)
    args = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(num_processes)]
    if not any(a.startswith("--num_machines") or a == "--config_file" for a in extra):
        args += ["--num_machines", "1"]
    if not cuda and not {"--cpu", "--multi_gpu", "--config_file"} & set(extra):
        args.append("--multi_gpu" if num_processes > 1 else "--cpu")
    if "--config_file" not in extra:
        args += ["--mixed_precision", "no", "--dynamo_backend", "no"]
    if port is not None:
        args += ["--main_process_port", str(port)]
    return [*args, *extra]


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


def _pop_num_processes(options: list[str]) -> tuple[int | None, list[str]]:
    """``--num_processes N`` (or ``=N``) taken out of ``options``; None where it is not given."""
    rest, n, it = [], None, iter(options)
    for arg in it:
        if arg == "--num_processes":
            n = int(next(it, "1"))
        elif arg.startswith("--num_processes="):
            n = int(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    return n, rest


def launch_argv(options: Sequence[str], command: str, args: Sequence[str], *, cuda: bool) -> list[str]:
    """The ``accelerate launch`` command line that runs ``bert-mp COMMAND ARGS`` on every process; a
    ``--num_processes N`` on a machine without CUDA starts N CPU processes (:func:`accelerate_launch`)."""
    n, rest = _pop_num_processes(list(options))
    base = (
        accelerate_launch(n, cuda=cuda, extra=rest)
        if n is not None
        else [sys.executable, "-m", "accelerate.commands.launch", *rest]
    )
    return [*base, "-m", "bert_mp", command, *args]


SHUTDOWN_TIMEOUT_S = 600
"""How long torch elastic's launcher lets the ranks finish their step, save and stop after a signal
before it kills them (its own default, 30 s, cuts a checkpoint of a large model, or of any model on
a loaded machine, short: the run then ends without its checkpoint and summary)."""


def launcher_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The launcher's environment: ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` set to
    :data:`SHUTDOWN_TIMEOUT_S` unless the user set it."""
    import os

    from bert_mp.core.run.machines import LAUNCHER_PID_ENV

    env = dict(environ)
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    env[LAUNCHER_PID_ENV] = str(os.getpid())  # where a stop that reached another machine is passed on
    return env


def run_launcher(argv: Sequence[str]) -> int:
    """Run ``argv`` (an ``accelerate launch``) in its own process group and pass it every SIGINT or
    SIGTERM this process gets, once. After a signal the ranks save and stop, each printing as a plain
    ``bert-mp train`` would (the main rank's line), and this returns 128 + signal. A rank that ends
    with a mistake in the input leaves its one line for this process (``console.error``): the lowest
    rank's line is printed once and its exit code returned (2, or 4 for a refused write). Either way
    the launcher's own report of what happened (a traceback, exit 1) is dropped; anything else the
    launcher or a rank wrote on stderr meanwhile is shown."""
    import contextlib
    import os
    import signal
    import subprocess
    import tempfile

    from bert_mp.core.run import console

    with tempfile.TemporaryDirectory(prefix="bert-mp-launch-") as errors:
        env = {**launcher_env(os.environ), console.LAUNCH_ERRORS_ENV: errors}
        # its own group: a terminal's Ctrl-C reaches this process only, which passes it on exactly once
        proc = subprocess.Popen(list(argv), stderr=subprocess.PIPE, text=True, process_group=0, env=env)
        caught: list[int] = []

        def forward(signum: int, frame: object) -> None:
            caught.append(signum)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signum)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        held: list[str] = []
        try:
            for line in proc.stderr:  # type: ignore[union-attr]
                ended = caught or any(Path(errors).iterdir())  # a signal, or a rank's error: hold the rest
                if ended and not line.startswith("bert-mp "):
                    held.append(line)  # judged once the launcher has ended
                    continue
                sys.stderr.write(line)
                sys.stderr.flush()
            code = proc.wait()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        reported = console.launch_errors(errors)
    if code == 0 or not (caught or reported):
        sys.stderr.writelines(held)
        return code
    if not any(report in line for line in held for report in _LAUNCHER_REPORTS):
        sys.stderr.writelines(held)  # not the launcher's own report: show it all
    if caught:
        return 128 + caught[0]
    line, rank_code = reported[0]
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    return rank_code


def command(argv: Sequence[str]) -> int:
    """``bert-mp launch [accelerate launch options] train|finetune [CONFIG] [key=value ...]``."""
    if not argv or argv[0] in ("-h", "--help"):
        print(LAUNCH_HELP)
        return 0
    import torch

    from bert_mp.core.run.machines import machines_of, meet, pop_join_timeout

    options, cmd, args = split_launch_args(argv)
    join_timeout, options = pop_join_timeout(options)
    machines = machines_of(options)
    if machines is not None:  # every machine present, or one line: before the launcher's rendezvous
        meet(machines, join_timeout)
    return run_launcher(launch_argv(options, cmd, args, cuda=torch.cuda.is_available()))


LAUNCH_HELP = """usage: bert-mp launch [ACCELERATE LAUNCH OPTIONS] {train,finetune} [CONFIG.yaml] [key=value ...]

Runs `accelerate launch ... -m bert_mp COMMAND ...`. Without CUDA, `--num_processes N` starts N CPU
processes (gloo); a plain `accelerate launch --cpu --num_processes N` starts one. Ctrl-C or SIGTERM
is passed to the launcher once; the ranks finish their step, save a checkpoint and stop, and this
exits 130 / 143 with the run's one stopped line (not torch elastic's traceback and exit 1).
With --num_machines N the machines meet first: one that has not come within --join_timeout SECONDS
(default 300) ends the others with one line, exit 2."""


# --------------------------------------------------------------------------------------------------
# a plain `accelerate launch` that starts fewer processes than it was asked for
# --------------------------------------------------------------------------------------------------
def requested_processes() -> int | None:
    """``--num_processes`` of the ``accelerate launch`` that started this process (its parent, the
    simple launcher Accelerate uses for ``--cpu``); None when there is none or it does not say."""
    import os

    if "ACCELERATE_USE_CPU" not in os.environ:  # set by accelerate launch for the processes it starts
        return None
    try:
        import psutil

        parent = psutil.Process().parent()
        cmdline = parent.cmdline() if parent else []
    except Exception:  # noqa: BLE001 (no psutil, no permission: nothing to say)
        return None
    if not any("accelerate" in part for part in cmdline[:3]):
        return None
    try:
        return _pop_num_processes(cmdline)[0]
    except ValueError:
        return None


def process_count_warning(world: int) -> str | None:
    """A warning when ``accelerate launch`` was asked for more processes than run (None: all is well)."""
    asked = requested_processes()
    if asked is None or asked <= world:
        return None
    return (
        f"accelerate launch was asked for {asked} processes, but {world} runs: on a CPU, Accelerate starts "
        "one process for --cpu (or a CPU config without multi-process settings); run "
        f"`bert-mp launch --num_processes {asked} ...`, or add --multi_gpu, or use "
        "--config_file configs/accelerate/cpu_multiprocess.yaml"
    )
