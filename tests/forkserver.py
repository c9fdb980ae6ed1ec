"""A fork server for the suite's ``python -m bert_mp`` commands.

A fresh Python that runs a bert_mp command spends 4-6 CPU seconds importing torch, transformers,
accelerate and datasets before the command does anything: on a 2-core machine that was most of what
the CLI tests cost. Here one server per pytest worker and *import environment* imports all of it
once, then forks a child per command. The child becomes the process a fresh interpreter started from
the asking process would be (tests/forkchild.py): its own pid, standard streams, environment, working
folder, signal dispositions and mask, umask, CPU affinity, resource limits, process group or session,
``__main__``, argv, ``sys.path[0]``, random state, exit status - and skips only what a fresh
interpreter would have done at import time. So that the skip is invisible:

- a server serves only commands whose environment matches its own in every variable a library may
  read at import (all but :data:`RUNTIME_ONLY`); another environment gets a server of its own (so a
  command that sets ``PYTHONHASHSEED`` gets a server with that hash seed);
- what the imports changed in the environment (bert_mp's ``quiet_libraries`` defaults, the oneDNN
  ISA cap of ``BERT_MP_CPU_MASK``) is applied to each child's environment, as the imports would have;
- the server imports with ``quiet_libraries()`` in force, as ``bert-mp`` does before importing a
  command; ``--debug`` / ``BERT_MP_DEBUG=1`` commands run as fresh processes;
- a server whose imports printed anything, or that holds a Python thread or an OS thread other than
  those a fork is known to be safe with (:func:`_threads_problem`) after them, is not used: its
  commands run as fresh processes (``BERT_MP_TEST_FORKSERVER=0`` runs every command so);
- a command asked from a session other than the server's (a sweep started in a session of its own)
  runs fresh: a forked child could not join the asker's process group there.

What a forked command still sees otherwise than a fresh one: ``/proc/PID/cmdline`` and its parent
(the server's); the modules, warning filters and logging set-up of every import the server made (a
fresh run of the same commands - ``BERT_MP_TEST_FORKSERVER=0`` - is what finds an import bug); the
server's hash seed, shared with its other children where ``PYTHONHASHSEED`` is unset (no fork can
change a running interpreter's hash secret); ``ru_maxrss`` starting at the server's resident memory.

:func:`popen` and :func:`run` take ``subprocess.Popen`` / ``subprocess.run`` arguments; a command
line that is not ``[sys.executable, "-m", "bert_mp", ...]`` - or ``[sys.executable, SCRIPT, ...]`` for
a script of ``scripts/`` that calls ``quiet_libraries()`` before its imports, as ``bert-mp`` does -
goes to ``subprocess`` unchanged. The child's CPU seconds (its own and its waited-for descendants')
are added to :data:`CPU_SECONDS`, which the suite's CPU report counts (``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import forkchild

SWITCH_ENV = "BERT_MP_TEST_FORKSERVER"
RUNTIME_ONLY_PREFIXES = ("BERT_MP_",)
"""bert_mp's own switches are read when a command acts on them (hold points, traces, launcher
facts), never at import; the two below are the exceptions."""
IMPORT_TIME = ("BERT_MP_CPU_MASK", "BERT_MP_DEBUG")
RUNTIME_ONLY = ("PYTEST_CURRENT_TEST", "PYTEST_XDIST_TESTRUNUID", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
RUNTIME_ONLY += ("DS_ACCELERATOR",)
"""``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``: read when a launcher's config is made (set by a sweep for its
runs). ``DS_ACCELERATOR``: read by DeepSpeed's import, which only a run that uses DeepSpeed makes (a
server whose imports took DeepSpeed in is not used); every in-process CPU run of a worker sets it."""
MAX_SERVERS = 4
CPU_SECONDS = 0.0
"""CPU seconds of the servers' imports and of the children they ran, for the suite's CPU report."""

_MSG = 1 << 20


def _runtime_only(name: str) -> bool:
    if name in IMPORT_TIME:
        return False
    return name in RUNTIME_ONLY or name.startswith(RUNTIME_ONLY_PREFIXES)


def import_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """What a server is kept by: ``env`` without the variables read only at run time, with the
    defaults ``quiet_libraries()`` sets before any import (a command sets them the same way)."""
    from bert_mp.core.process.noise import QUIET_ENV

    env = {**QUIET_ENV, **env}
    return tuple(sorted((k, v) for k, v in env.items() if not _runtime_only(k)))


def child_environment(env: dict[str, str], delta: dict[str, str], removed: list[str]) -> dict[str, str]:
    """A child's environment: its command's, changed as the server's imports changed the server's."""
    out = {k: v for k, v in env.items() if k not in removed}
    out.update(delta)
    return out


# --------------------------------------------------------------------------------------------------
# the server (this file run as a script)
# --------------------------------------------------------------------------------------------------
def _preload() -> None:
    import importlib

    from bert_mp.core.process.noise import quiet_libraries

    quiet_libraries(False)
    import bert_mp.cli as cli

    for module, _, _ in cli.COMMANDS.values():
        importlib.import_module(module)
    cli.build_parser()
    # what the commands import when they run
    for module in ("accelerate", "transformers.models.bert.modeling_bert", "datasets", "bert_mp.model.bert"):
        importlib.import_module(module)


class _Spoke(Exception):
    """Raised by :class:`_SpeechWatch`: the imports have printed something."""


class _SpeechWatch:
    """An import hook that ends the server's imports at the first import after anything was printed
    (the server is refused then anyway): a library that speaks early costs a fraction of the imports."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        sys.stdout.flush()
        if os.fstat(self.fd).st_size:
            raise _Spoke(name)
        return None


def _serve(path: str) -> None:
    ready = os.fdopen(os.dup(1), "w")
    before = dict(os.environ)
    problem = None
    with tempfile.TemporaryFile() as said:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(said.fileno(), 1)
        os.dup2(said.fileno(), 2)
        watch = _SpeechWatch(said.fileno())
        sys.meta_path.insert(0, watch)
        try:
            _preload()
        except _Spoke:  # refused at the first import after something printed: no need to import the rest
            pass
        except BaseException as e:  # noqa: BLE001 (reported to the client, which runs fresh instead)
            problem = f"the imports failed: {e!r}"
        finally:
            sys.meta_path.remove(watch)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        said.seek(0)
        printed = said.read().decode(errors="replace")
    if printed:  # first: a failure after the watch stopped the imports is its consequence
        problem = f"the imports printed: {printed[:800]!r}"
    if "deepspeed" in sys.modules and problem is None:  # its DS_ACCELERATOR would be import-time
        problem = "the imports took DeepSpeed in: DS_ACCELERATOR would be read at import"
    problem = problem or _threads_problem()
    try:  # how a child's end is seen (Linux 5.3+)
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError) as e:
        problem = problem or f"no pidfd on this system: {e!r}"
    after = dict(os.environ)
    delta = {k: v for k, v in after.items() if before.get(k) != v}
    removed = [k for k in before if k not in after]
    keep_fds = {int(fd) for fd in os.listdir("/proc/self/fd")} - {0, 1, 2, ready.fileno()}
    keep_fds = {fd for fd in keep_fds if _is_open(fd)}  # the listing's own descriptor is gone
    times = os.times()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    said = {"problem": problem, "cpu": times.user + times.system, "delta": delta, "removed": removed}
    ready.write(json.dumps(said) + "\n")
    ready.flush()
    ready.close()
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)  # the client stopped reading; a child gets its own streams anyway
    os.close(null)
    if problem is not None:
        return
    import gc

    rngs = forkchild.random_generators()
    gc.collect()
    gc.freeze()  # the imported objects out of the children's collections: no copy-on-write of them
    key = import_key(child_environment(before, delta, removed))
    home = {"path": path, "key": key, "delta": delta, "removed": removed, "sid": os.getsid(0)}
    _loop(listener, home, keep_fds, rngs)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


FORK_SAFE_THREADS = ("jemalloc_bg_thd",)
"""OS threads a fork may leave behind (by ``/proc/self/task/*/comm``): pyarrow's jemalloc background
thread, whose library holds every lock of its own across a fork (its ``pthread_atfork`` handlers) and
starts the thread again in the child when needed."""


def _threads_problem() -> str | None:
    """Why a fork of this process could copy a thread's half-done work, or None. A fork copies the
    calling thread only: a Python thread (or another OS thread) holding a lock would leave it locked in
    every child. numpy's OpenBLAS starts its worker threads at import and stops them in its own
    ``pthread_atfork`` handler (they start again when a child uses BLAS): one fork here, then what
    is left is what every later fork meets."""
    import threading

    if threading.active_count() > 1:
        return f"{threading.enumerate()} after the imports: forking would copy one of them only"
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    others = []
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != threading.get_native_id():
            with contextlib.suppress(OSError):  # ended meanwhile
                others.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
    unknown = [name for name in others if name not in FORK_SAFE_THREADS]
    if unknown:
        return f"OS threads {unknown} after the imports: forking would copy this thread only"
    return None


def _loop(listener: socket.socket, home: dict, keep_fds: set[int], rngs: list) -> None:
    """Accept jobs and fork them until stdin closes (the pytest worker is gone). Single-threaded: a
    pidfd per child says when to reap it, so no thread exists to be lost in a fork."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin, selectors.EVENT_READ, "parent")
    own: list[Any] = [listener, sys.stdin]  # closed in each child
    running: dict[int, tuple[socket.socket, int, int, int]] = {}  # pidfd -> (conn, pid, pidfd, asker)
    credit: dict[int, float] = {}  # pid -> CPU seconds of the commands it asked for that ended
    while True:
        for key, _ in sel.select():
            if key.data == "parent":
                if not os.read(sys.stdin.fileno(), 4096):
                    return
            elif key.data == "accept":
                conn, _ = listener.accept()
                data, fds, _, _ = socket.recv_fds(conn, _MSG, 3)
                job = json.loads(data)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    for obj in own + [conn] + [c for c, *_ in running.values()]:
                        with contextlib.suppress(OSError):
                            obj.close()
                    for pidfd in running:
                        with contextlib.suppress(OSError):
                            os.close(pidfd)
                    sel.close()
                    _child(job, fds, home, keep_fds, rngs)  # never returns
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                running[pidfd] = (conn, pid, pidfd, job["asker"])
                sel.register(pidfd, selectors.EVENT_READ, "child")
                with contextlib.suppress(OSError):
                    conn.send(json.dumps({"pid": pid}).encode())
            else:
                conn, pid, pidfd, asker = running.pop(key.fd)
                sel.unregister(pidfd)
                os.close(pidfd)
                _, status, usage = os.wait4(pid, 0)
                cpu = usage.ru_utime + usage.ru_stime + credit.pop(pid, 0.0)
                if any(asker == p for _, p, _, _ in running.values()):
                    # a command one of this server's children asked for (a sweep's run) would have
                    # been that child's child: its CPU seconds count in that child's
                    credit[asker] = credit.get(asker, 0.0) + cpu
                reply = {"returncode": os.waitstatus_to_exitcode(status), "cpu": cpu}
                with contextlib.suppress(OSError):
                    conn.send(json.dumps(reply).encode())
                conn.close()


def _child(job: dict, fds: list[int], home: dict, keep_fds: set[int], rngs: list) -> None:
    """Become the command (tests/forkchild.py): its environment (the command's, changed as the
    server's imports changed the server's), folder, streams, signals, process group or session, then
    run it as ``python -m bert_mp`` (or ``python SCRIPT``) would and end as the interpreter ends."""
    global _HOME
    _HOME = home
    _route_sweep_runs(None)  # a sweep's runs: forked from this server too, where their environment allows
    job["env"] = child_environment(job["env"], home["delta"], home["removed"])
    server = sys.modules["__main__"]  # noqa: F841 (held: the command gets a __main__ of its own)
    forkchild.become(job, fds, keep_fds, rngs)


# --------------------------------------------------------------------------------------------------
# the client (in the pytest worker)
# --------------------------------------------------------------------------------------------------
class _Server:
    def __init__(self, env: dict[str, str]) -> None:
        global CPU_SECONDS
        self.dir = tempfile.mkdtemp(prefix="bert-mp-forkserver-")
        self.path = os.path.join(self.dir, "socket")
        self.log = open(os.path.join(self.dir, "server.log"), "w")  # noqa: SIM115 (lives with the server)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, self.path],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            cwd=self.dir,
        )
        line = self.proc.stdout.readline()
        self.proc.stdout.close()
        try:
            ready = json.loads(line)
        except ValueError:
            ready = {"problem": f"did not start: {Path(self.log.name).read_text()[-2000:]}", "cpu": 0.0}
        self.problem = ready["problem"]
        self.delta, self.removed = ready.get("delta", {}), ready.get("removed", [])
        self.sid = os.getsid(0)  # the server's: started in this process's session
        CPU_SECONDS += ready["cpu"]
        if self.problem:
            import warnings

            # said once per server, in pytest's warnings summary: these commands now start fresh
            warnings.warn(f"fork server not used, its commands run fresh: {self.problem}", stacklevel=3)
            self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


_SERVERS: dict[tuple, _Server] = {}
_SEEN: set[tuple] = set()
_HOME: dict | None = None
"""In a forked child: the server it came from (socket path, import key after the imports, what the
imports set and removed, its session). A command it starts goes to that server or runs fresh; it
starts none."""


class _Home:
    problem = None

    def __init__(self, home: dict) -> None:
        self.path, self.sid = home["path"], home["sid"]


def _route_sweep_runs(monkeypatch: Any) -> None:
    """A sweep's runs through :func:`popen` (``bert_mp.sweep.runner.start_run``), their CPU seconds
    counted as its children's. ``monkeypatch``: undone when the test ends (an in-process sweep);
    None: for good (a forked child)."""
    from bert_mp.sweep import runner

    def children_cpu_seconds() -> float:
        return runner._children_cpu_seconds() + CPU_SECONDS

    setattr_ = monkeypatch.setattr if monkeypatch is not None else setattr
    setattr_(runner, "start_run", popen)
    setattr_(runner, "children_cpu_seconds", children_cpu_seconds)


def route_sweep_runs(monkeypatch: Any) -> None:
    """For a test that runs a sweep in its own process: its runs are forked from a server."""
    _route_sweep_runs(monkeypatch)


def _server(env: dict[str, str], eager: bool = False) -> _Server | None:
    """The server for ``env``'s import environment; None the first time one is asked for (unless
    ``eager``: a sweep, whose runs repay it): a server costs one start-up of its own, repaid from the
    second command on, and many a command in a new environment is a one-off mistake that a fresh
    process reports before importing anything."""
    if _HOME is not None:
        key = import_key(child_environment(env, _HOME["delta"], _HOME["removed"]))
        return _Home(_HOME) if key == _HOME["key"] else None
    key = import_key(env)
    if key not in _SEEN and not eager:
        _SEEN.add(key)
        return None
    return server_for(env)


def server_for(env: dict[str, str]) -> _Server:
    """The server for ``env``'s import environment, started now if there is none."""
    key = import_key(env)
    _SEEN.add(key)
    server = _SERVERS.pop(key, None)
    if server is None:
        if len(_SERVERS) >= MAX_SERVERS:
            _SERVERS.pop(next(iter(_SERVERS))).close()
        server = _Server(dict(key))
    _SERVERS[key] = server  # most recently used last
    return server


def close_servers() -> None:
    while _SERVERS:
        _SERVERS.popitem()[1].close()


SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
QUIET_CALL = "quiet_libraries()"
"""A script of the repository's ``scripts/`` that calls this before its imports (as ``bert-mp`` does)
imports what the server imported, under the same quiet defaults: it is forked too."""


def _bert_mp_args(args: Any) -> list[str] | None:
    args = list(args) if not isinstance(args, (str, bytes)) else None
    if not args or [str(a) for a in args[:3]] != [sys.executable, "-m", "bert_mp"]:
        return None
    rest = [str(a) for a in args[3:]]
    # `bert-mp launch` imports little (torch only with a CUDA build) and starts its ranks afresh
    return None if "--debug" in rest or rest[:1] == ["launch"] else rest


def _script_args(args: Any) -> tuple[str, list[str]] | None:
    """``(script, arguments)`` of ``[sys.executable, SCRIPT, ...]`` where SCRIPT is one of ``scripts/``
    that keeps to the quiet defaults (:data:`QUIET_CALL`); None for anything else."""
    args = list(args) if not isinstance(args, (str, bytes)) else None
    if not args or len(args) < 2 or str(args[0]) != sys.executable or not str(args[1]).endswith(".py"):
        return None
    script = Path(args[1])
    try:
        inside = script.resolve().is_relative_to(SCRIPTS) and QUIET_CALL in script.read_text(encoding="utf-8")
    except OSError:
        return None
    return (str(script), [str(a) for a in args[2:]]) if inside else None


class ForkedProcess:
    """A command run by a fork server, with the parts of ``subprocess.Popen``'s interface the tests
    use: ``pid``, ``args``, ``returncode``, ``stdin``/``stdout``/``stderr``, ``poll``, ``wait``,
    ``communicate``, ``send_signal``, ``terminate``, ``kill``. Signals go through a pidfd, so one can
    never reach another process that took the pid after this one was reaped."""

    def __init__(self, args: list[str], conn: socket.socket, text: bool, pipes: dict[str, int]) -> None:
        self.args = args
        self.returncode: int | None = None
        self._conn = conn
        self._text = text
        reply = json.loads(conn.recv(_MSG))
        self.pid: int = reply["pid"]
        try:
            self._pidfd: int | None = os.pidfd_open(self.pid)
        except ProcessLookupError:  # ended and reaped already: its status is on the way
            self._pidfd = None
        self.stdin = os.fdopen(pipes["stdin"], "w" if text else "wb") if "stdin" in pipes else None
        self.stdout = self._reader(pipes.get("stdout"))
        self.stderr = self._reader(pipes.get("stderr"))

    def _reader(self, fd: int | None) -> Any:
        if fd is None:
            return None
        return io.TextIOWrapper(os.fdopen(fd, "rb")) if self._text else os.fdopen(fd, "rb")

    def _status(self, timeout: float | None) -> int | None:
        global CPU_SECONDS
        if self.returncode is not None:
            return self.returncode
        self._conn.settimeout(timeout)
        try:
            data = self._conn.recv(_MSG)
        except (TimeoutError, BlockingIOError):
            return None
        finally:
            self._conn.settimeout(None)
        if not data:
            raise RuntimeError(f"the fork server went away while {self.args} ran")
        reply = json.loads(data)
        CPU_SECONDS += reply["cpu"]
        self.returncode = reply["returncode"]
        self._conn.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        return self.returncode

    def poll(self) -> int | None:
        return self._status(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        import selectors

        deadline = None if timeout is None else time.monotonic() + timeout
        if self.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                if input:
                    self.stdin.write(input)
                self.stdin.close()
        streams = {
            name: f
            for name, f in (("out", self.stdout), ("err", self.stderr))
            if f is not None and not f.closed
        }
        chunks: dict[str, list[bytes]] = {name: [] for name in streams}
        sel = selectors.DefaultSelector()
        for name, f in streams.items():
            raw = f.buffer if self._text else f
            sel.register(raw.fileno(), selectors.EVENT_READ, name)
        try:
            while sel.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in sel.select(left):
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        chunks[key.data].append(data)
                    else:
                        sel.unregister(key.fd)
        finally:
            sel.close()
        for f in streams.values():
            f.close()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.wait(left)
        out = {name: b"".join(parts) for name, parts in chunks.items()}
        if self._text:
            out = {k: v.decode().replace("\r\n", "\n").replace("\r", "\n") for k, v in out.items()}
        return out.get("out"), out.get("err")

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        for f in (self.stdout, self.stderr, self.stdin):
            if f is not None:
                f.close()
        self.wait()


def _fd_of(spec: Any, default: int, pipe_end: str, pipes: dict[str, int], close_after: list[int]) -> int:
    if spec is None:
        try:
            os.fstat(default)
            return default
        except OSError:  # a closed standard stream: the child gets /dev/null there
            spec = subprocess.DEVNULL
    if spec == subprocess.PIPE:
        r, w = os.pipe()
        mine, theirs = (w, r) if pipe_end == "stdin" else (r, w)
        pipes[pipe_end] = mine
        close_after.append(theirs)
        return theirs
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        close_after.append(fd)
        return fd
    return spec if isinstance(spec, int) else spec.fileno()


def popen(
    args: Any,
    *,
    cwd: Any = None,
    env: dict[str, str] | None = None,
    stdin: Any = None,
    stdout: Any = None,
    stderr: Any = None,
    text: bool = False,
    start_new_session: bool = False,
) -> Any:
    """``subprocess.Popen(args, ...)``, through a fork server where ``args`` is a bert_mp command (or
    one of the repository's scripts that keeps to the same quiet defaults: :func:`_script_args`)."""
    rest, script = _bert_mp_args(args), _script_args(args)
    if script is not None:
        script, rest = script
    env = dict(os.environ if env is None else env)
    use = rest is not None and os.environ.get(SWITCH_ENV, "1") != "0" and env.get("BERT_MP_DEBUG") != "1"
    server = _server(env, eager=script is None and rest[:1] == ["sweep"]) if use else None
    if server is not None and not start_new_session and os.getsid(0) != server.sid:
        # a sweep in a session of its own (start_cli): a forked run could not join its process group
        # (a group belongs to one session), and a killpg of the sweep must reach its runs
        server = None
    if server is None or server.problem:
        return subprocess.Popen(
            args,
            cwd=cwd,
            env=env,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            text=text,
            start_new_session=start_new_session,
        )
    pipes: dict[str, int] = {}
    close_after: list[int] = []
    try:
        fds = [_fd_of(stdin, 0, "stdin", pipes, close_after), _fd_of(stdout, 1, "stdout", pipes, close_after)]
        fds.append(fds[1] if stderr == subprocess.STDOUT else _fd_of(stderr, 2, "stderr", pipes, close_after))
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(server.path)
        job = {
            "asker": os.getpid(),
            "asker_state": forkchild.asker_state(),
            "orig_argv": [str(a) for a in args],
            "args": rest,
            "script": script,
            "env": env,
            "cwd": os.path.abspath(cwd or os.getcwd()),
            "new_session": start_new_session,
        }
        socket.send_fds(conn, [json.dumps(job).encode()], fds)
    finally:
        for fd in close_after:
            os.close(fd)
    return ForkedProcess(list(args), conn, text, pipes)


def run(
    args: Any,
    *,
    cwd: Any = None,
    env: dict[str, str] | None = None,
    capture_output: bool = False,
    text: bool = False,
    timeout: float | None = None,
    input: Any = None,
    check: bool = False,
    stdin: Any = None,
    stdout: Any = None,
    stderr: Any = None,
) -> subprocess.CompletedProcess:
    """``subprocess.run(args, ...)``, through a fork server where ``args`` is a bert_mp command."""
    if capture_output:
        stdout = stderr = subprocess.PIPE
    if input is not None:
        stdin = subprocess.PIPE
    proc = popen(args, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr, text=text)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


if __name__ == "__main__":
    _FOLDER, _SERVER_PID = os.path.dirname(sys.argv[1]), os.getpid()
    try:
        _serve(sys.argv[1])
    finally:  # its folder goes with it, also where the worker was killed and could not close it
        if os.getpid() == _SERVER_PID:  # a child never gets here (it ends in os._exit): never in one
            import shutil

            shutil.rmtree(_FOLDER, ignore_errors=True)
