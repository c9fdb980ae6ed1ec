"""Starting ``accelerate launch`` and what a rank learns of the launch that started it: the command
line for N processes on this machine (shared by ``bert-mp launch``, ``bert-mp sweep``, the scale-out
benchmark and the multi-process tests), the launcher's environment, and a warning where a plain
``accelerate launch`` started fewer processes than it was asked for.

Accelerate 1.x starts ONE process for ``--cpu --num_processes N`` (unless an MPI hostfile is
given); torchrun-style spawning (``--multi_gpu``) starts N, and bert_mp puts each on the CPU with
gloo when there is no CUDA. So without CUDA, N > 1 processes are launched with ``--multi_gpu``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from bert_mp.core.process.launcher import LAUNCHER_PID_ENV


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


def pop_num_processes(options: list[str]) -> tuple[int | None, list[str]]:
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


SHUTDOWN_TIMEOUT_S = 600
"""How long torch elastic's launcher lets the ranks finish their step, save and stop after a signal
before it kills them (its own default, 30 s, cuts a checkpoint of a large model, or of any model on
a loaded machine, short: the run then ends without its checkpoint and summary)."""


def launcher_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The launcher's environment: ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` set to
    :data:`SHUTDOWN_TIMEOUT_S` unless the user set it."""
    env = dict(environ)
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    env[LAUNCHER_PID_ENV] = str(os.getpid())  # watched by the ranks; where a relayed stop is passed on
    return env


def requested_processes() -> int | None:
    """``--num_processes`` of the ``accelerate launch`` that started this process (its parent, the
    simple launcher Accelerate uses for ``--cpu``); None when there is none or it does not say."""
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
        return pop_num_processes(cmdline)[0]
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
