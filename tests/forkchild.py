"""What a child of the suite's fork server (tests/forkserver.py) does to become its command.

A fresh command is an interpreter that ``subprocess.Popen`` started from the asking process (the
pytest worker, or a sweep). So the child takes from the asker what an exec'd process inherits - its
ignored signals, signal mask, process group, umask, CPU affinity and resource limits
(:func:`asker_state`, sent with the job) - and from the interpreter what it sets at its start: signal
dispositions, a fresh ``__main__``, ``sys.argv`` / ``sys.path[0]`` / ``sys.orig_argv``, standard
streams, random state seeded from the system. Then it runs the command as ``python -m bert_mp`` or
``python SCRIPT`` does, and ends the way the interpreter ends (:func:`_finalize`): uncaught errors
printed as the interpreter prints them, non-daemon threads joined, atexit handlers run, the standard
streams flushed, exit status as the interpreter computes it; then ``os._exit``, so nothing of the
server's own stack (its loop, its clean-up) runs in the child.

The atexit handlers a child runs are those its imports registered: the server registers none of its
own, and the libraries' (``logging.shutdown``, multiprocessing's, weakref finalizers) are the ones the
same imports register in a fresh process. What a fresh interpreter does after them and a child does
not: tear down every module (``__del__`` of objects still referenced at exit); a child collects
garbage once instead.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import signal
import sys
import types
from typing import Any, NoReturn

INTERPRETER_IGNORES = (signal.SIGPIPE, signal.SIGXFSZ)
"""Ignored by CPython at its start (``subprocess`` resets them to the default before it execs)."""
UNSETTABLE = (signal.SIGKILL, signal.SIGSTOP)


def _proc_status(field: str) -> str:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(line.split()[1] for line in f if line.startswith(field + ":"))


def asker_state() -> dict[str, Any]:
    """What a process started from this one (this thread) inherits through fork and exec."""
    import resource

    ignored = int(_proc_status("SigIgn"), 16)
    return {
        "ignored": [n for n in signal.valid_signals() if ignored >> (n - 1) & 1],
        "blocked": [int(n) for n in signal.pthread_sigmask(signal.SIG_BLOCK, [])],
        "pgrp": os.getpgrp(),
        "umask": int(_proc_status("Umask"), 8),  # read, not set and reset: other threads may create files
        "affinity": sorted(os.sched_getaffinity(0)),
        "rlimits": {
            name: resource.getrlimit(getattr(resource, name))
            for name in dir(resource)
            if name.startswith("RLIMIT_")
        },
    }


# --------------------------------------------------------------------------------------------------
# becoming the command
# --------------------------------------------------------------------------------------------------
def become(job: dict, fds: list[int], keep_fds: set[int], rngs: list) -> NoReturn:
    """Turn this forked child into ``job``'s command and run it; never returns. ``fds``: its standard
    streams; ``keep_fds``: the descriptors the server's imports opened (a fresh process opens its own);
    ``rngs``: the random generators the imports seeded (:func:`random_generators`)."""
    try:
        asker = job["asker_state"]
        _signals_as_at_start(set(asker["ignored"]), asker["blocked"])
        os.environ.clear()
        os.environ.update(job["env"])
        os.chdir(job["cwd"])
        _take_descriptors(fds, keep_fds)
        _join(asker, job["new_session"])
        _standard_streams()
        _reseed(rngs)
    except BaseException:  # noqa: BLE001 (never into the server's frames: said on the command's stderr)
        import traceback

        os.write(
            2, f"fork server: the child could not become its command:\n{traceback.format_exc()}".encode()
        )
        os._exit(70)
    sys.orig_argv = list(job["orig_argv"])
    if job.get("script"):
        code, interrupted = _run_script(job["script"], job["args"])
    else:
        code, interrupted = _run_module("bert_mp", job["args"])
    _finalize(code, interrupted)


def _signals_as_at_start(ignored: set[int], blocked: list[int]) -> None:
    """Dispositions as an interpreter started from the asker has them: what the asker ignores stays
    ignored (an exec keeps it), everything else at its default; then what CPython sets at its start
    (SIGPIPE, SIGXFSZ ignored; SIGINT raises KeyboardInterrupt unless it came in ignored). The mask is
    the asker's. The server's own dispositions (inherited at the fork) are gone."""
    import faulthandler

    fault = faulthandler.is_enabled()  # PYTHONFAULTHANDLER (a server's import environment): on again below
    if fault:
        faulthandler.disable()
    for n in signal.valid_signals():
        if n not in UNSETTABLE:
            keep = n in ignored and n not in INTERPRETER_IGNORES
            signal.signal(n, signal.SIG_IGN if keep else signal.SIG_DFL)
    for n in INTERPRETER_IGNORES:
        signal.signal(n, signal.SIG_IGN)
    if signal.SIGINT not in ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    if fault:
        faulthandler.enable(file=2, all_threads=True)


def _take_descriptors(fds: list[int], keep: set[int]) -> None:
    """The command's standard streams on 0, 1, 2; every other descriptor closed but the imports' own
    (a fresh process has only its standard streams and what its imports open)."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):  # the listing's own descriptor, closed already
                os.close(fd)


def _join(asker: dict, new_session: bool) -> None:
    """Its process group and session as asked (the asker's group, or a session of its own), umask,
    CPU affinity and resource limits: the asker's."""
    import resource

    if new_session:
        os.setsid()
    elif os.getpgrp() != asker["pgrp"]:
        os.setpgid(0, asker["pgrp"])  # the client asks only from the server's session
    os.umask(asker["umask"])
    os.sched_setaffinity(0, asker["affinity"])
    for name, limits in asker["rlimits"].items():
        which = getattr(resource, name)
        if resource.getrlimit(which) != tuple(limits):
            resource.setrlimit(which, tuple(limits))


def _standard_streams() -> None:
    """``sys.stdin`` / ``stdout`` / ``stderr`` as CPython's start-up makes them (``create_stdio``):
    named ``<stdin>`` ..., newlines untranslated, line-buffered on a terminal (stderr always), written
    through and unbuffered under ``-u`` / ``PYTHONUNBUFFERED``."""
    buffered = not sys.__stdout__.write_through  # the server's, made so by the same interpreter and -u
    encoding, errors = sys.__stdout__.encoding, sys.__stdout__.errors

    def stream(fd: int, name: str, errs: str) -> io.TextIOWrapper:
        write = fd > 0
        buffering = -1 if buffered or not write else 0
        buf = open(fd, "wb" if write else "rb", buffering=buffering, closefd=False)  # noqa: SIM115
        (buf.raw if buffering else buf).name = name
        line = buffered and (os.isatty(fd) or fd == 2)
        text = io.TextIOWrapper(buf, encoding, errs, "\n", line_buffering=line, write_through=not buffered)
        text.mode = "w" if write else "r"
        return text

    streams = (
        stream(0, "<stdin>", errors),
        stream(1, "<stdout>", errors),
        stream(2, "<stderr>", "backslashreplace"),
    )
    sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__ = streams


def random_generators() -> list:
    """The random generators the imports created and seeded from the system (``random.Random()``
    instances: the module's own, ``datasets.fingerprint``'s, sympy's; numpy's global state; torch's
    default generator): each child seeds them again, as its own imports would have."""
    import gc
    import random

    kinds: tuple[type, ...] = (random.Random,)
    if "numpy" in sys.modules:
        import numpy

        kinds += (numpy.random.RandomState, numpy.random.Generator)
    # by type, never isinstance: an object's __class__ may be computed (a proxy, a lazy module)
    found = [
        o
        for o in gc.get_objects()
        if issubclass(type(o), kinds) and not issubclass(type(o), random.SystemRandom)
    ]
    if "torch" in sys.modules:
        found.append(sys.modules["torch"].default_generator)
    return found


def _reseed(rngs: list) -> None:
    for rng in rngs:
        if hasattr(rng, "bit_generator"):  # numpy's Generator: a new state of its kind, from the system
            rng.bit_generator.state = type(rng.bit_generator)().state
        else:  # random.Random, numpy's RandomState, torch's Generator: seed() with no seed is the system's
            rng.seed()


# --------------------------------------------------------------------------------------------------
# running it, and ending as the interpreter ends
# --------------------------------------------------------------------------------------------------
def _fresh_main() -> types.ModuleType:
    """``__main__`` as the interpreter creates it (the server's, with its globals, is not the command's)."""
    import importlib.machinery

    main = types.ModuleType("__main__")
    main.__loader__ = importlib.machinery.BuiltinImporter
    main.__annotations__ = {}
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    return main


def _run_module(name: str, args: list[str]) -> tuple[int, bool]:
    """``python -m NAME ARGS``: the interpreter calls ``runpy._run_module_as_main`` with ``-m`` in
    ``sys.argv[0]`` and the working folder first on the path."""
    import runpy

    if not sys.flags.safe_path:
        sys.path[0] = os.getcwd()
    sys.argv = ["-m", *args]
    _fresh_main()
    try:
        runpy._run_module_as_main(name)
    except BaseException as e:  # noqa: BLE001 (what the interpreter does with it, below)
        return _uncaught(e)
    return 0, False


def _run_script(path: str, args: list[str]) -> tuple[int, bool]:
    """``python PATH ARGS`` (``_PyRun_SimpleFileObject``): ``__file__`` the path joined to the working
    folder, the script's real folder first on the path, the source compiled with none of this module's
    future flags; ``__file__`` leaves ``__main__`` when the script ends (not when it exits)."""
    import importlib.machinery

    main = _fresh_main()
    main.__file__ = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    main.__cached__ = None
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", main.__file__)
    if not sys.flags.safe_path:
        sys.path[0] = os.path.dirname(os.path.realpath(path))
    sys.argv = [path, *args]
    try:
        with open(path, "rb") as f:
            code = compile(f.read(), main.__file__, "exec", dont_inherit=True)
        exec(code, main.__dict__)  # noqa: S102 (the command)
    except BaseException as e:  # noqa: BLE001 (what the interpreter does with it, below)
        _flush_io()
        if isinstance(e, SystemExit):  # the interpreter exits from inside its report: __file__ stays
            return _system_exit(e), False
        return _done_with_file(main, _uncaught(e))
    _flush_io()
    return _done_with_file(main, (0, False))


def _done_with_file(main: types.ModuleType, result: tuple[int, bool]) -> tuple[int, bool]:
    for key in ("__file__", "__cached__"):
        main.__dict__.pop(key, None)
    return result


def _flush_io() -> None:
    for stream in (sys.stderr, sys.stdout):
        with contextlib.suppress(Exception):
            stream.flush()


def _uncaught(e: BaseException) -> tuple[int, bool]:
    """An exception out of the command: SystemExit's code (and message), or the traceback from the
    command's first frame printed by ``sys.excepthook``, exit 1 (KeyboardInterrupt: ended by SIGINT)."""
    if isinstance(e, SystemExit):
        return _system_exit(e), False
    tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # not this module's frame
    e.__traceback__ = tb
    sys.last_type, sys.last_value, sys.last_traceback = type(e), e, tb
    try:
        sys.excepthook(type(e), e, tb)
    except SystemExit as hook_exit:
        return _system_exit(hook_exit), False
    except BaseException as hook_error:  # noqa: BLE001 (as the interpreter reports a failing hook)
        with contextlib.suppress(Exception):
            sys.stderr.write("Error in sys.excepthook:\n")
            sys.__excepthook__(type(hook_error), hook_error, hook_error.__traceback__)
            sys.stderr.write("\nOriginal exception was:\n")
            sys.__excepthook__(type(e), e, tb)
    return 1, isinstance(e, KeyboardInterrupt)


def _system_exit(e: SystemExit) -> int:
    """``_Py_HandleSystemExit``: None is 0, an integer is itself, anything else is printed and is 1."""
    code = e.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    with contextlib.suppress(Exception):
        sys.stderr.write(f"{code}\n")
    return 1


def _finalize(code: int, interrupted: bool) -> NoReturn:
    """``Py_FinalizeEx``'s part a command sees: non-daemon threads joined, atexit handlers, standard
    streams flushed (a failure makes the status 120), garbage collected; an uncaught
    KeyboardInterrupt ends the process by SIGINT. Then ``os._exit``: no frame of the server unwinds."""
    import atexit
    import gc

    if "threading" in sys.modules:
        try:
            sys.modules["threading"]._shutdown()
        except BaseException as e:  # noqa: BLE001 (reported as the interpreter reports it)
            _unraisable(sys.modules["threading"], e)
    atexit._run_exitfuncs()
    flushed = _flush_std_files()
    gc.collect()
    flushed = _flush_std_files() and flushed
    status = code if flushed else 120
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        status = 128 + signal.SIGINT  # still here: SIGINT is blocked
    os._exit(status & 0xFF)


def _unraisable(obj: object, e: BaseException) -> None:
    """What ``PyErr_WriteUnraisable(obj)`` prints (``sys.unraisablehook`` takes only the interpreter's
    own argument type): the object, then the exception, without this module's frame."""
    import traceback

    tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
    with contextlib.suppress(Exception):
        sys.stderr.write(
            f"Exception ignored in: {obj!r}\n" + "".join(traceback.format_exception(type(e), e, tb))
        )
        sys.stderr.flush()


def _flush_std_files() -> bool:
    """``flush_std_files``: stdout's failure is reported as unraisable, stderr's is not; False on either."""
    ok = True
    for stream, report in ((sys.stdout, True), (sys.stderr, False)):
        if stream is None or getattr(stream, "closed", False):
            continue
        try:
            stream.flush()
        except Exception as e:  # noqa: BLE001
            ok = False
            if report:
                _unraisable(stream, e)
    return ok
