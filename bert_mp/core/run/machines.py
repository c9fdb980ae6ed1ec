"""Several machines under ``bert-mp launch --num_machines N``: they meet before training, and a stop
reaches every one of them.

**Meeting.** Torch elastic's static rendezvous waits 600 s for a missing machine and then ends in a
traceback. So before it starts the launcher, ``bert-mp launch`` on every machine meets the others at
``--main_process_ip:--main_process_port``: machine 0 listens there, the others connect and say their
rank, and once all N are in, machine 0 answers each and closes the port for the launcher's own
rendezvous. A machine that has not come within ``--join_timeout`` seconds (default
:data:`JOIN_TIMEOUT_S`) ends the others with one line naming it (exit 2); nothing has started.

**Stopping.** SIGTERM or Ctrl-C reaches the launcher of one machine, whose ranks pass it on through
the step's all-reduced stop flag (:func:`bert_mp.core.loop.state.signal_flag`): every rank of every machine
finishes the step, the checkpoint is saved together and each rank records the same stop reason. The
other machines' launchers never saw the signal; so the first rank of each (``LOCAL_RANK`` 0), once
the run is saved and its summary written, sends the same signal to its own ``bert-mp launch``
(:data:`LAUNCHER_PID_ENV`), which ends as the signalled one does: the ranks' stopped line, exit 130
/ 143.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bert_mp.errors import LaunchError

JOIN_TIMEOUT_S = 300.0
"""How long machines wait for each other before a launch gives up (``--join_timeout``)."""
LAUNCHER_PID_ENV = "BERT_MP_LAUNCHER_PID"
"""Set by ``bert-mp launch`` for its processes: the process to pass a stop on to (see the module docstring)."""
_HELLO, _GO = b"bert-mp machine ", b"go\n"


@dataclass(frozen=True)
class Machines:
    """Where the machines of a launch meet (accelerate launch's options, or its config file's keys)."""

    count: int
    rank: int
    ip: str
    port: int


def _option(options: Sequence[str], name: str) -> str | None:
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
    config = _option(options, "--config_file")
    if config and Path(config).is_file():
        import yaml

        with contextlib.suppress(OSError, yaml.YAMLError, AttributeError):
            doc = yaml.safe_load(Path(config).read_text(encoding="utf-8")) or {}
            keys.update({k: str(doc[k]) for k in keys if doc.get(k) is not None})
    keys.update({k: v for k in keys if (v := _option(options, f"--{k}")) is not None})
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


def meet(m: Machines, timeout: float) -> None:
    """Return once all ``m.count`` machines have come (see the module docstring); :class:`LaunchError`,
    one line, when one has not come within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    if m.rank == 0:
        _host(m, deadline, timeout)
    else:
        _join(m, deadline, timeout)


def _host(m: Machines, deadline: float, timeout: float) -> None:
    try:
        server = socket.create_server(("", m.port))
    except OSError as e:
        raise LaunchError(
            f"machine 0 cannot listen on --main_process_port {m.port} ({e.strerror or e}); choose a free port"
        ) from None
    joined: dict[int, socket.socket] = {}
    try:
        while len(joined) < m.count - 1:
            server.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                conn, _ = server.accept()
            except TimeoutError:
                missing = sorted(set(range(1, m.count)) - set(joined))
                names = ", ".join(str(r) for r in missing)
                raise LaunchError(
                    f"machine{'s' if len(missing) > 1 else ''} {names} of {m.count} did not join within "
                    f"{timeout:g} s (--join_timeout) at {m.ip}:{m.port}; start the same `bert-mp launch` "
                    "with --machine_rank set on every other machine, or check --main_process_ip"
                ) from None
            rank = _read_rank(conn, deadline)
            if rank is None or rank in joined or not 0 < rank < m.count:
                conn.close()  # not one of ours (a port probe, a duplicate): not counted
                continue
            joined[rank] = conn
        for conn in joined.values():
            with contextlib.suppress(OSError):
                conn.sendall(_GO)
    finally:
        for conn in joined.values():
            conn.close()
        server.close()


def _read_rank(conn: socket.socket, deadline: float) -> int | None:
    conn.settimeout(max(0.01, min(5.0, deadline - time.monotonic())))
    try:
        data = conn.recv(64)
    except OSError:
        return None
    if not data.startswith(_HELLO):
        return None
    try:
        return int(data[len(_HELLO) :].strip())
    except ValueError:
        return None


def _join(m: Machines, deadline: float, timeout: float) -> None:
    conn = None
    while conn is None:
        try:
            conn = socket.create_connection(
                (m.ip, m.port), timeout=max(0.01, min(2.0, deadline - time.monotonic()))
            )
        except OSError:
            if time.monotonic() >= deadline:
                raise LaunchError(
                    f"machine 0 did not answer at {m.ip}:{m.port} within {timeout:g} s (--join_timeout); start "
                    "`bert-mp launch ... --machine_rank 0` there, or check --main_process_ip / --main_process_port"
                ) from None
            time.sleep(0.2)  # machine 0 is not listening yet: try again until the deadline
    with conn:
        conn.sendall(_HELLO + str(m.rank).encode() + b"\n")
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            answer = conn.recv(8)
        except OSError:
            answer = b""
    if answer != _GO:
        raise LaunchError(
            f"machine 0 at {m.ip}:{m.port} gave up before every machine of {m.count} had joined "
            f"(within {timeout:g} s, --join_timeout); start them all within that time"
        )


# --------------------------------------------------------------------------------------------------
# a stop that reached another machine
# --------------------------------------------------------------------------------------------------
RELAY_WAIT_S = 60.0
"""How long the first rank of a machine waits for its launcher to pass the relayed signal back."""


def relay_stop(pending_signal: str | None, stop_reason: str | None) -> None:
    """After a run stopped for a signal that this machine's launcher never got (it reached another
    machine): the first rank of this machine sends the same signal to its ``bert-mp launch`` and waits
    until the launcher passes it back, so that the launcher has it before this rank exits."""
    launcher = os.environ.get(LAUNCHER_PID_ENV, "")
    if pending_signal or not launcher.isdigit() or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    name = (stop_reason or "").removeprefix("signal ")
    if name not in ("SIGTERM", "SIGINT") or threading.current_thread() is not threading.main_thread():
        return
    signum = signal.Signals[name]
    # blocked, so that the signal coming back is taken here (sigtimedwait), not by a handler
    signal.pthread_sigmask(signal.SIG_BLOCK, [signum])
    try:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(int(launcher), signum)
            signal.sigtimedwait([signum], RELAY_WAIT_S)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
