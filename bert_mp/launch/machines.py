"""Several machines under ``bert-mp launch --num_machines N``: they meet through torch elastic's
rendezvous, and a machine that never comes ends the others with one line.

**Meeting.** Accelerate starts torch elastic's static rendezvous at ``--main_process_ip:
--main_process_port`` (machine 0's agent hosts its store, ``--machine_rank`` sets each machine's
ranks). Its own wait is 600 s, ended by a traceback; ``bert-mp launch`` passes ``--join_timeout``
(default :data:`JOIN_TIMEOUT_S`) as the rendezvous timeout (``--rdzv_conf timeout=S``) and turns what
the engine raises when it runs out into one line (:func:`join_failure`, exit 2): machine 0's
``DistStoreError`` (``Timed out after S seconds waiting for clients. K/N clients joined.``) names the
machines that did not come; another machine's ``DistNetworkError`` (its client timed out connecting)
says that machine 0 did not answer. Nothing has trained by then.

Torch elastic's c10d rendezvous is not the default (it ignores ``--machine_rank``, so rank 0 can land
on any machine; docs/architecture.md has the measurement); a launch that asks for it gets it, with
``join_timeout`` set from ``--join_timeout``. A stop that reaches one machine is passed on to the
others by the ranks: :mod:`bert_mp.core.process.launcher`.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

JOIN_TIMEOUT_S = 300.0
"""How long machines wait for each other before a launch gives up (``--join_timeout``)."""


@dataclass(frozen=True)
class Machines:
    """Where the machines of a launch meet (accelerate launch's options, or its config file's keys)."""

    count: int
    rank: int
    ip: str
    port: int


def option(options: Sequence[str], name: str) -> str | None:
    """The value of ``name`` in ``options`` (``--name V`` or ``--name=V``; the last one wins)."""
    value = None
    for i, arg in enumerate(options):
        if arg == name and i + 1 < len(options):
            value = options[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def pop_join_timeout(options: Sequence[str]) -> tuple[float, list[str]]:
    """``--join_timeout S`` taken out of ``options`` (bert-mp's own option, not accelerate's)."""
    from bert_mp.errors import ConfigError

    rest, timeout, it = [], JOIN_TIMEOUT_S, iter(options)
    for arg in it:
        if arg == "--join_timeout" or arg.startswith("--join_timeout="):
            value = arg.split("=", 1)[1] if "=" in arg else next(it, "")
            try:
                timeout = float(value)
            except ValueError:
                timeout = -1.0
            if timeout <= 0:
                raise ConfigError(
                    f"--join_timeout {value!r}: give the seconds to wait for the other machines"
                )
        else:
            rest.append(arg)
    return timeout, rest


def machines_of(options: Sequence[str]) -> Machines | None:
    """The machines a launch spans, from its options over its ``--config_file``; None for one machine."""
    from bert_mp.errors import ConfigError

    keys = {"num_machines": "1", "machine_rank": "0", "main_process_ip": None, "main_process_port": "29500"}
    config = option(options, "--config_file")
    if config and Path(config).is_file():
        import yaml

        with contextlib.suppress(OSError, yaml.YAMLError, AttributeError):
            doc = yaml.safe_load(Path(config).read_text(encoding="utf-8")) or {}
            keys.update({k: str(doc[k]) for k in keys if doc.get(k) is not None})
    keys.update({k: v for k in keys if (v := option(options, f"--{k}")) is not None})
    try:
        count, rank, port = (
            int(keys["num_machines"]),
            int(keys["machine_rank"]),
            int(keys["main_process_port"]),
        )
    except ValueError as e:
        raise ConfigError(
            f"--num_machines, --machine_rank and --main_process_port take integers ({e})"
        ) from None
    if count <= 1:
        return None
    if not keys["main_process_ip"]:
        raise ConfigError(f"--num_machines {count}: give --main_process_ip, the address of machine 0")
    if not 0 <= rank < count:
        raise ConfigError(f"--machine_rank {rank}: must be 0 to {count - 1} for --num_machines {count}")
    return Machines(count, rank, str(keys["main_process_ip"]), port)


def rendezvous_options(options: Sequence[str], timeout: float) -> list[str]:
    """``options`` with the rendezvous timeout set to ``timeout`` seconds (see the module docstring),
    added to a ``--rdzv_conf`` the user gave (their own timeout wins)."""
    c10d = option(options, "--rdzv_backend") == "c10d"
    key = "join_timeout" if c10d else "timeout"
    given = option(options, "--rdzv_conf") or ""
    if re.search(rf"(^|,){key}=", given):
        return list(options)
    conf = ",".join(p for p in (given, f"{key}={math.ceil(timeout)}") if p)
    rest, skip = [], False
    for arg in options:
        if skip:
            skip = False
        elif arg == "--rdzv_conf":
            skip = True
        elif not arg.startswith("--rdzv_conf="):
            rest.append(arg)
    return [*rest, "--rdzv_conf", conf]


_NOT_JOINED = re.compile(r"Timed out after \d+ seconds waiting for clients\. (\d+)/(\d+) clients joined")
_NO_ANSWER = re.compile(r"(client socket has timed out|connection to the C10d store has failed)")
_RDZV_TIMEOUT = re.compile(r"RendezvousTimeoutError")
_PORT_BUSY = re.compile(r"Tried to launch distributed communication on port `?(\d+)`?, but another process")


def join_failure(text: str, m: Machines, timeout: float) -> str | None:
    """The one line for a rendezvous that ran out (what the launcher wrote: ``text``), or None when
    ``text`` says nothing of the kind."""
    where, within = f"{m.ip}:{m.port}", f"within {timeout:g} s (--join_timeout)"
    if found := _PORT_BUSY.search(text):
        return f"machine 0 cannot listen on --main_process_port {found.group(1)} (in use); choose a free port"
    if found := _NOT_JOINED.search(text):
        joined, count = int(found.group(1)), int(found.group(2))
        missing = count - joined
        who = f"machine 1 of {count}" if count == 2 else f"{missing} of the {count} machines"
        return (
            f"{who} did not join {within} at {where}; start the same `bert-mp launch` with "
            "--machine_rank set on every other machine, or check --main_process_ip"
        )
    if _NO_ANSWER.search(text):
        return (
            f"machine 0 did not answer at {where} {within}; start `bert-mp launch ... --machine_rank 0` "
            "there, or check --main_process_ip / --main_process_port"
        )
    if _RDZV_TIMEOUT.search(text):
        return (
            f"the {m.count} machines did not all join {within} at {where}; start the same "
            "`bert-mp launch` on every machine, or check --main_process_ip / --main_process_port"
        )
    return None
