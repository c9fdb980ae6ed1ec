"""A command forked by the suite's fork server (tests/forkserver.py) against the same command in a fresh
interpreter, on what a command can observe of its process: signal dispositions and mask, argv and
``__main__``, working folder, environment, ``sys.path``, standard streams, hash seed, random state,
open files, threads, process group and session; and how it ends (exit status, what it writes, its
atexit handlers and threads). Every forked command here is asserted to have gone through a server."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get(forkserver.SWITCH_ENV, "1") == "0", reason=f"{forkserver.SWITCH_ENV}=0: nothing is forked"
)

PROBE = '''"""Reports what a command can observe of its own process."""

MAIN = {k: type(v).__name__ for k, v in globals().items()}  # before anything is defined here

import json
import os
import signal
import sys
import threading


def _kernel_mask(field):
    for line in open("/proc/self/status", encoding="ascii"):
        if line.startswith(field + ":"):
            bits = int(line.split()[1], 16)
            return [n for n in sorted(signal.valid_signals()) if bits >> (n - 1) & 1]


def _disposition(n):
    handler = signal.getsignal(n)
    names = {signal.SIG_DFL: "default", signal.SIG_IGN: "ignored", signal.default_int_handler: "KeyboardInterrupt"}
    return names.get(handler, "C" if handler is None else "Python")


STATE = {
    "main": MAIN,
    "file": __file__,
    "loader": [type(__loader__).__name__, getattr(__loader__, "name", None), getattr(__loader__, "path", None)],
    "argv": sys.argv,
    "orig_argv": sys.orig_argv,
    "executable": sys.executable,
    "flags": list(sys.flags),
    "path": sys.path,
    "cwd": os.getcwd(),
    "env": dict(os.environ),
    "umask": os.umask(0o022),
    "affinity": sorted(os.sched_getaffinity(0)),
    "pgrp": os.getpgrp(),
    "sid": os.getsid(0),
    "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
    "threads": len(os.listdir("/proc/self/task")),
    "stdio": [[repr(s), s.line_buffering, s.write_through, s.errors, type(s.buffer).__name__]
              for s in (sys.stdin, sys.stdout, sys.stderr)],
    "hash": hash("bert-mp fork server probe"),
    "signals": {n: _disposition(n) for n in sorted(signal.valid_signals()) if n not in (9, 19)},
    "kernel": {f: _kernel_mask(f) for f in ("SigIgn", "SigCgt", "SigBlk")},
}
os.umask(STATE["umask"])

from bert_mp.core.process.noise import quiet_libraries

quiet_libraries()
mode = sys.argv[1] if len(sys.argv) > 1 else ""
if mode.endswith(".json"):  # a path first: the report goes there, with the random draws of the libraries
    import random

    import numpy
    import torch
    from datasets.fingerprint import generate_random_fingerprint

    STATE["random"] = [random.random(), float(numpy.random.random()), float(torch.rand(1)),
                       generate_random_fingerprint()]
    with open(mode, "w", encoding="utf-8") as f:
        json.dump(STATE, f)
    print(json.dumps(STATE))
    import atexit

    atexit.register(print, "atexit handler", flush=False)
    done = threading.Event()
    thread = threading.Thread(target=lambda: done.wait() and print("thread joined at exit", end=" "))
    thread.start()
    print("buffered, flushed at exit", end=" ")
    done.set()
    raise ValueError("the probe ends with an error")
if mode == "interrupt":
    raise KeyboardInterrupt
if mode == "exit-message":
    sys.exit("probe: a message for stderr")
if mode == "run":  # a sweep's run: where it is
    print(json.dumps([os.getpgrp(), os.getsid(0)]))
    sys.exit(0)
if mode == "sweep":  # a sweep: starts a run as bert_mp.sweep.runner does, and says where both are
    import subprocess
    from pathlib import Path

    from bert_mp.sweep import runner

    if sys.argv[2] == "group":
        os.setpgid(0, 0)  # a process group of its own; the Unix session stays the asker's
    routed = getattr(runner.start_run, "__globals__", {})
    if "SCRIPTS" in routed:  # forked: the fork server's popen, for which this probe is one of scripts/
        routed["SCRIPTS"] = Path(__file__).parent
    run = runner.start_run([sys.executable, __file__, "run"], stdout=subprocess.PIPE)
    out, _ = run.communicate()
    print(json.dumps({"sweep": [os.getpgrp(), os.getsid(0)], "run": json.loads(out), "how": type(run).__name__}))
    sys.exit(run.returncode)
print(json.dumps(STATE))
'''

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
ENV["PYTHONHASHSEED"] = "4242"  # a server of its own, started in this module (and a hash to compare)


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    """The probe as one of scripts/ (forkserver.SCRIPTS points at its folder while the module runs),
    and a server for ENV started while SIGTERM was ignored here: a fresh command has SIGTERM's default
    whatever its server started with."""
    folder = tmp_path_factory.mktemp("scripts")
    (folder / "probe.py").write_text(PROBE)
    saved = forkserver.SCRIPTS
    forkserver.SCRIPTS = folder
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        server = forkserver.server_for(ENV)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not server.problem, server.problem
    yield folder / "probe.py"
    forkserver.SCRIPTS = saved


@contextlib.contextmanager
def _asker_state():
    """What the asking process hands on to a command it starts: SIGHUP ignored (as under nohup),
    SIGUSR2 blocked, umask 027."""
    hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
    umask = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(umask)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGHUP, hup)


def _forked(args: list, cwd: Path, **kw) -> subprocess.CompletedProcess:
    proc = forkserver.popen(args, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
    assert isinstance(proc, forkserver.ForkedProcess), (
        "not forked: the comparison would be fresh against fresh"
    )
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _fresh(args: list, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=ENV, capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def runs(probe, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """The probe with a path first (``NAME/out.json``), forked twice and fresh once, under
    :func:`_asker_state`."""
    cwd = tmp_path_factory.mktemp("work")
    done = {}
    with _asker_state():
        for name, start in (("forked", _forked), ("fresh", _fresh), ("sibling", _forked)):
            (cwd / name).mkdir()
            done[name] = start([sys.executable, str(probe), f"{name}/out.json"], cwd)
            done[name].cwd = cwd
    return done


def _state(run: subprocess.CompletedProcess) -> dict:
    return json.loads(run.stdout.splitlines()[0])


def test_the_folder_of_a_path_first_argument_stays(runs):
    for name, run in runs.items():
        assert (run.cwd / name / "out.json").is_file(), f"{name}: the folder of its first argument is gone"


def test_signal_dispositions_and_mask_are_a_fresh_interpreters(runs):
    """SIGTERM at its default though the server started ignoring it; SIGHUP ignored and SIGUSR2
    blocked as the asker had them when it asked; SIGINT raises KeyboardInterrupt, SIGPIPE and SIGXFSZ
    ignored, as the interpreter sets them at its start."""
    forked, fresh = _state(runs["forked"]), _state(runs["fresh"])
    assert fresh["signals"][str(int(signal.SIGTERM))] == "default"
    assert (
        fresh["signals"][str(int(signal.SIGHUP))] == "ignored" and signal.SIGUSR2 in fresh["kernel"]["SigBlk"]
    )
    assert (forked["signals"], forked["kernel"]) == (fresh["signals"], fresh["kernel"])


def test_argv_main_path_folder_streams_and_process_are_a_fresh_interpreters(runs, probe):
    """Everything but the environment (below), the random draws (below) and the folder of its
    argument; with PYTHONHASHSEED set, the same string hashes."""
    forked, fresh = _state(runs["forked"]), _state(runs["fresh"])
    assert forked["argv"] == [str(probe), "forked/out.json"] and fresh["argv"] == [
        str(probe),
        "fresh/out.json",
    ]
    for state in (forked, fresh):
        del state["argv"][1], state["orig_argv"][2], state["env"], state["random"]
    differ = {k: {"forked": forked[k], "fresh": fresh[k]} for k in forked if forked[k] != fresh[k]}
    assert not differ, json.dumps(differ, indent=1)[:6000]
    assert forked["umask"] == 0o027 and forked["threads"] == 1


def test_the_environment_is_the_commands_plus_what_the_imports_set(runs):
    forked, fresh = _state(runs["forked"]), _state(runs["fresh"])
    assert forked["env"] == {**fresh["env"], **forkserver.server_for(ENV).delta}


def test_random_state_is_drawn_apart_as_in_fresh_processes(runs):
    """random, numpy's global state, torch's default generator and datasets' fingerprints: each
    process draws its own (a fresh one seeds them from the system at import)."""
    draws = [_state(runs[name])["random"] for name in ("forked", "sibling", "fresh")]
    for a, b in zip(*draws[:2]):
        assert a != b, draws


def test_it_ends_as_a_fresh_one(runs):
    """Its uncaught error's traceback, line for line; a non-daemon thread joined and the atexit
    handler run at exit, after which the buffered output is flushed; exit status 1."""
    ended = {}
    for name in ("forked", "fresh"):
        run = runs[name]
        ended[name] = (
            run.returncode,
            run.stdout.splitlines()[1:],
            run.stderr.replace(f"{name}/".encode(), b""),
        )
    assert ended["forked"] == ended["fresh"]
    assert ended["fresh"][:2] == (1, [b"buffered, flushed at exit thread joined at exit atexit handler"])
    assert ended["fresh"][2].decode().splitlines()[-1] == "ValueError: the probe ends with an error"


@pytest.mark.parametrize(
    "args",
    [
        [],  # no argument: exits 0
        ["interrupt"],  # an uncaught KeyboardInterrupt: its traceback, then killed by SIGINT
        ["exit-message"],  # sys.exit("message"): the message, exit 1
    ],
    ids=["no-argv", "KeyboardInterrupt", "exit-message"],
)
def test_a_forked_script_ends_as_a_fresh_one(probe, tmp_path, args):
    cmd = [sys.executable, str(probe), *args]
    forked, fresh = _forked(cmd, tmp_path), _fresh(cmd, tmp_path)
    if not args:
        forked.stdout, fresh.stdout = (json.loads(r.stdout)["argv"] for r in (forked, fresh))
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode == {(): 0, ("interrupt",): -signal.SIGINT, ("exit-message",): 1}[tuple(args)]


def test_a_bare_python_m_bert_mp_prints_its_usage_and_exits_2_as_a_fresh_one(tmp_path):
    cmd = [sys.executable, "-m", "bert_mp"]
    forked, fresh = _forked(cmd, tmp_path), _fresh(cmd, tmp_path)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode == 2 and fresh.stderr.decode().startswith("usage: bert-mp")


@pytest.mark.parametrize("where", ["group", "session"])
def test_a_forked_sweeps_run_is_in_the_sweeps_process_group_and_session(probe, tmp_path, where):
    """A sweep starts its runs through bert_mp.sweep.runner.start_run: a run is in the sweep's process
    group (a killpg of the sweep reaches it) and session, whether the sweep made a group of its own or
    was started in a session of its own (``start_cli``)."""
    cmd = [sys.executable, str(probe), "sweep", where]
    sweep = _forked(cmd, tmp_path, start_new_session=where == "session")
    assert sweep.returncode == 0, sweep.stderr.decode()[-2000:]
    said = json.loads(sweep.stdout)
    assert said["run"] == said["sweep"], said
    assert said["sweep"][0] != os.getpgrp()  # a group other than the asker's (and its server's)
    if where == "group":
        assert said["how"] == "ForkedProcess"  # its run forked too, then into the sweep's group
