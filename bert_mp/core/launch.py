"""The ``accelerate launch`` command line for N processes on this machine, shared by ``bert-mp
sweep``, the scale-out benchmark and the multi-process tests.

Accelerate 1.x starts ONE process for ``--cpu --num_processes N`` (unless an MPI hostfile is
given); torchrun-style spawning (``--multi_gpu``) starts N, and bert_mp puts each on the CPU with
gloo when there is no CUDA. So without CUDA, N > 1 processes are launched with ``--multi_gpu``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


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
