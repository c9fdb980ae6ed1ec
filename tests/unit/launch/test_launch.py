"""The shared ``accelerate launch`` command line (sweep, scale-out benchmark, multi-process tests), and
what ``bert-mp launch`` says when its ranks end: a mistake, a stop, a death, machines that never met."""

from __future__ import annotations

import os
import sys

from bert_mp.core.process.spawn import accelerate_launch


def _value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_n_processes_on_a_cpu_are_spawned_torchrun_style():
    cmd = accelerate_launch(2, cuda=False, port=29555)
    assert cmd[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    # `--cpu --num_processes 2` would start ONE process in Accelerate 1.x
    assert "--multi_gpu" in cmd and "--cpu" not in cmd
    assert _value(cmd, "--num_processes") == "2" and _value(cmd, "--num_machines") == "1"
    assert _value(cmd, "--mixed_precision") == "no" and _value(cmd, "--main_process_port") == "29555"
    one = accelerate_launch(1, cuda=False)
    assert "--cpu" in one and "--multi_gpu" not in one and "--main_process_port" not in one


def test_a_config_file_or_explicit_flags_win():
    cmd = accelerate_launch(2, cuda=False, extra=["--config_file", "c.yaml"])
    assert cmd[-2:] == ["--config_file", "c.yaml"]
    assert not {"--multi_gpu", "--cpu", "--num_machines", "--mixed_precision"} & set(cmd)
    cuda = accelerate_launch(4, cuda=True, extra=["--num_machines=2"])
    assert not {"--multi_gpu", "--cpu"} & set(cuda) and "--num_machines" not in cuda


def test_the_launcher_gives_the_ranks_time_to_save_after_a_signal(monkeypatch, capfd):
    """torch elastic kills the ranks 30 s after it passes a signal on unless told otherwise; a
    checkpoint on a loaded machine (or of a large model) takes longer. The launcher is started with
    a longer grace period, and a value the user set is kept."""
    from bert_mp.core.process.spawn import SHUTDOWN_TIMEOUT_S
    from bert_mp.launch.command import run_launcher

    show = [sys.executable, "-c", "import os; print(os.environ['TORCH_ELASTIC_SHUTDOWN_TIMEOUT'])"]
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert run_launcher(show) == 0
    assert capfd.readouterr().out.strip() == str(SHUTDOWN_TIMEOUT_S)
    assert SHUTDOWN_TIMEOUT_S > 30
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "45")
    assert run_launcher(show) == 0
    assert capfd.readouterr().out.strip() == "45"


# a stand-in for `accelerate launch`: two "ranks" meet the same mistake (each leaves its line as
# bert_mp's CLI does), then the launcher reports the failed children with a traceback and exits 1
FAKE_LAUNCHER = r"""
import os, sys
from bert_mp.core.process import console, notes
for rank in ("1", "0"):
    os.environ["RANK"] = rank
    console.error("bert-mp train: error: train.global_batch_size=32 must be ... (rank %s)" % rank, 2)
sys.stderr.write("W1128 torch/distributed/elastic: Sending process 7 closing signal SIGTERM\n")
sys.stderr.write("Traceback (most recent call last):\n  File x\n")
sys.stderr.write("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n=====\nbert_mp FAILED\n")
sys.exit(1)
"""


def test_a_mistake_the_ranks_meet_is_one_line_from_one_rank_and_exit_2(capfd):
    from bert_mp.launch.command import run_launcher

    assert run_launcher([sys.executable, "-c", FAKE_LAUNCHER]) == 2
    err = capfd.readouterr().err
    assert err == "bert-mp train: error: train.global_batch_size=32 must be ... (rank 0)\n", err


def test_what_a_failing_launcher_says_otherwise_is_shown_as_it_is(capfd):
    """No rank left a line (a crash, not a mistake in the input): the launcher's exit code and all it said."""
    from bert_mp.launch.command import run_launcher

    crash = "import sys; sys.stderr.write('Traceback (most recent call last):\\nValueError: boom\\n'); sys.exit(1)"
    assert run_launcher([sys.executable, "-c", crash]) == 1
    assert capfd.readouterr().err == "Traceback (most recent call last):\nValueError: boom\n"


def test_an_error_line_is_one_write_outside_a_launch(monkeypatch, capfd):
    from bert_mp.core.process import console, notes

    monkeypatch.delenv(notes.LAUNCH_ERRORS_ENV, raising=False)
    console.error("bert-mp train: error: x", 2)
    assert capfd.readouterr().err == "bert-mp train: error: x\n"


def test_a_global_batch_the_processes_cannot_split_names_a_value_that_works():
    import pytest

    from bert_mp.core.loop.state import BatchGeometry
    from bert_mp.errors import ConfigError

    keys = ("train.global_batch_size", "train.micro_batch_size")
    with pytest.raises(ConfigError) as err:
        BatchGeometry.build(32, 32, 2, *keys)
    assert str(err.value) == (
        "train.global_batch_size=32 must be a multiple of train.micro_batch_size (32) x processes (2); "
        "with 2 processes set train.micro_batch_size=16 (accumulation 1), or change train.global_batch_size"
    )
    with pytest.raises(ConfigError, match=r"set train.micro_batch_size=12 \(accumulation 2\)"):
        BatchGeometry.build(48, 16, 2, *keys)  # 24 per process: 16 does not divide it, 12 does
    with pytest.raises(ConfigError, match=r"; set train.global_batch_size=36 \(a multiple of 4 x 3\)$"):
        BatchGeometry.build(32, 4, 3, *keys)  # no micro-batch splits 32 over 3 processes
    assert BatchGeometry.build(32, 16, 2, *keys).accumulation == 1


# --------------------------------------------------------------------------------------------------
# a rank's death, a stopped run, machines that do not meet: one line each
# --------------------------------------------------------------------------------------------------
ELASTIC_TABLE = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
bert_mp FAILED
------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-28_19:37:58
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 6929)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 6929
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-28_19:37:58
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 6928)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
======================================================
"""
"""Torch elastic's report after rank 1 was killed, the survivor's collective error named the root cause."""

# a stand-in for `accelerate launch` whose rank 1 died after the run saved step 6 and logged step 7
DYING_LAUNCHER = r"""
import json, os, sys
from pathlib import Path
from bert_mp.core.process import console, notes
run = Path("run")
(run / "checkpoints" / "step_00000006").mkdir(parents=True)
notes.tell_launcher_the_run_folder(run)
notes.tell_launcher(notes.CHECKPOINT_NOTE, run / "checkpoints" / "step_00000006")
(run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "kind": "train"}) + "\n" for s in range(1, 8)))
sys.stderr.write("[rank0]: Traceback (most recent call last):\n[rank0]: RuntimeError: Connection reset by peer\n")
sys.stderr.write("Traceback (most recent call last):\n  File x\n" + sys.argv[1])
sys.exit(1)
"""


def test_a_rank_killed_by_a_signal_is_one_line_and_the_rest_goes_to_the_run_folder_log(
    tmp_path, monkeypatch, capfd
):
    from bert_mp.launch.command import LaunchContext, run_launcher
    from bert_mp.launch.report import RANK_DIED_EXIT_CODE

    monkeypatch.chdir(tmp_path)
    argv = ["--num_processes", "2", "train", "r.yaml", "train.save_every=2", "train.resume=latest"]
    code = run_launcher([sys.executable, "-c", DYING_LAUNCHER, ELASTIC_TABLE], LaunchContext(argv, "train"))
    assert code == RANK_DIED_EXIT_CODE == 5
    (line,) = capfd.readouterr().err.splitlines()
    log = tmp_path / "run" / "launch.log"
    assert line == (
        "bert-mp launch: error: rank 1 (pid 6929 on localhost) was killed by SIGKILL (the out-of-memory "
        "killer's signal, among others) after step 7 (the last one logged); torch elastic ended the other ranks; the last "
        "checkpoint saved is run/checkpoints/step_00000006; continue the run with `bert-mp launch "
        "--num_processes 2 train r.yaml train.save_every=2 train.resume=latest`; what the ranks and the "
        f"launcher wrote: {log}"
    )
    kept = log.read_text()
    assert kept.startswith("$ bert-mp launch --num_processes 2 train r.yaml")
    assert "RuntimeError: Connection reset by peer" in kept and "exitcode  : -9 (pid: 6929)" in kept


def test_the_rank_that_died_first_is_named_whatever_torch_elastic_calls_the_root_cause():
    from bert_mp.launch.report import culprit, parse_failures

    failures = parse_failures(ELASTIC_TABLE)
    assert [(f.rank, f.exitcode, f.pid, f.root) for f in failures] == [
        (1, -9, 6929, False),
        (0, 1, 6928, True),
    ]
    assert culprit(failures).rank == 1  # SIGKILL, not the survivor's collective error
    closed = parse_failures(ELASTIC_TABLE.replace("-9 (pid: 6929)  (SIGKILL)", "-15 (pid: 6929)  (SIGTERM)"))
    assert culprit(closed).rank == 0  # ended by the agent: the other one's error is the cause
    assert parse_failures("Traceback (most recent call last):\nValueError: boom\n") == []


def test_a_stopped_rank_leaves_its_exit_code_and_the_launcher_report_is_dropped(capfd):
    from bert_mp.launch.command import run_launcher

    stopped = (
        "import sys; from bert_mp.core.process import console; console.ended(3); "
        f"sys.stderr.write({ELASTIC_TABLE!r}); sys.exit(1)"
    )
    assert run_launcher([sys.executable, "-c", stopped]) == 3
    assert capfd.readouterr().err == ""


def test_machines_meet_through_the_engine_with_the_join_timeout_and_a_timeout_is_one_line():
    from bert_mp.launch.machines import Machines, join_failure, rendezvous_options

    assert rendezvous_options(["--num_machines", "2"], 2.5) == [
        "--num_machines",
        "2",
        "--rdzv_conf",
        "timeout=3",
    ]
    mine = ["--rdzv_conf", "read_timeout=9", "--x"]
    assert rendezvous_options(mine, 300) == ["--x", "--rdzv_conf", "read_timeout=9,timeout=300"]
    assert rendezvous_options(["--rdzv_conf=timeout=7"], 300) == ["--rdzv_conf=timeout=7"]  # theirs wins
    assert rendezvous_options(["--rdzv_backend", "c10d"], 60)[-1] == "join_timeout=60"
    m0, m1 = Machines(2, 0, "10.0.0.1", 29500), Machines(2, 1, "10.0.0.1", 29500)
    waited = (
        "torch.distributed.DistStoreError: Timed out after 3 seconds waiting for clients. 1/2 clients joined."
    )
    assert join_failure(waited, m0, 2) == (
        "machine 1 of 2 did not join within 2 s (--join_timeout) at 10.0.0.1:29500; start the same "
        "`bert-mp launch` with --machine_rank set on every other machine, or check --main_process_ip"
    )
    three = waited.replace("1/2", "1/3")
    assert join_failure(three, Machines(3, 0, "h", 1), 2).startswith(
        "2 of the 3 machines did not join within 2 s"
    )
    unanswered = "DistNetworkError: The client socket has timed out after 2000ms while trying to connect to (10.0.0.1, 29500)."
    assert join_failure(unanswered, m1, 2).startswith("machine 0 did not answer at 10.0.0.1:29500 within 2 s")
    assert join_failure("Traceback ...\nValueError: boom\n", m1, 2) is None


def test_a_rank_keeps_running_when_its_launchers_pipe_is_gone():
    """Under ``bert-mp launch`` a rank's stderr is a pipe to the launcher: once the launcher is killed,
    a write there (a progress bar) must not end the rank before it has saved."""
    import subprocess

    from bert_mp.core.process import notes

    child = (
        "import sys; from bert_mp.core.process import notes; notes.guard_stderr_under_launch(); "
        "sys.stdin.readline(); [sys.stderr.write('bar ' * 1000 + '\\n') for _ in range(100)]; sys.stderr.flush(); "
        "print('saved', flush=True)"
    )
    env = {**os.environ, notes.LAUNCH_ERRORS_ENV: "/"}
    proc = subprocess.Popen(
        [sys.executable, "-c", child],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    proc.stderr.close()  # the launcher is gone: nobody reads the rank's stderr any more
    out, _ = proc.communicate("go\n", timeout=60)
    assert (proc.returncode, out) == (0, "saved\n")


def _stand_in():
    """A process that runs until killed (a stand-in for ``bert-mp launch``)."""
    import subprocess

    return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)


def test_the_watch_sees_its_launcher_end(monkeypatch):
    from bert_mp.core.process import launcher

    assert not launcher.LauncherWatch(None).gone()  # not under bert-mp launch: never
    for pidfd in (True, False):
        stand_in = _stand_in()
        with monkeypatch.context() as m:
            m.setattr(launcher, "_started_after_me", lambda pid: False)  # younger than the test: fine here
            if not pidfd:  # an old kernel: psutil instead
                m.setattr(launcher.os, "pidfd_open", lambda pid: (_ for _ in ()).throw(OSError(38, "ENOSYS")))
            watch = launcher.LauncherWatch(stand_in.pid)
        assert not watch.gone()
        stand_in.kill()
        stand_in.wait()
        assert watch.gone() and watch.gone()
        watch.close()
    # a pid that now belongs to a process younger than this one: its launcher ended before
    young = _stand_in()
    assert launcher.LauncherWatch(young.pid).gone()
    young.kill()
    young.wait()


def test_the_launcher_knows_a_cpu_build_of_torch_without_importing_it(tmp_path, monkeypatch):
    """``bert-mp launch`` reads the installed torch's build (its ``version.py``): a CPU build is no
    CUDA, without torch's start-up; a CUDA or ROCm build asks ``torch.cuda.is_available()``."""
    import importlib.machinery
    import importlib.util
    import subprocess
    import types

    from bert_mp.launch import command as launch

    code = "import sys; from bert_mp.launch.command import cuda_available as c; print(c(), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    import torch

    if torch.version.cuda is None and torch.version.hip is None:  # this machine's CPU wheel
        assert out.split() == ["False", "False"]
    for cuda, hip, asked in ((None, None, False), ("12.8", None, True), (None, "6.4", True)):
        pkg = tmp_path / f"t{cuda}{hip}" / "torch"
        pkg.mkdir(parents=True)
        (pkg / "version.py").write_text(f"cuda = {cuda!r}\nhip = {hip!r}\n")
        spec = importlib.machinery.ModuleSpec("torch", None, is_package=True)
        spec.submodule_search_locations = [str(pkg)]
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, s=spec: s)
        calls = []
        fake = types.SimpleNamespace(
            cuda=types.SimpleNamespace(is_available=lambda c=calls: c.append(1) or True)
        )
        monkeypatch.setitem(sys.modules, "torch", fake)
        assert launch.cuda_available() is asked and bool(calls) is asked


def test_a_stopped_rank_under_a_launcher_outlives_the_agents_sigterm_before_and_after_the_relay():
    """A machine's first rank, its run stopped and saved, passes the stop on to its own launcher
    (``relay_stop``) and exits with its stopped line. torch elastic's agent sends SIGTERM to the ranks
    still running once one has exited, or when the launcher passes a signal on: before the relay (the
    rank then leaves the relay to the signal already under way) or after it, the rank is not cut
    short. Each case in a fresh process that stands in for its own launcher."""
    import subprocess

    from bert_mp.core.process import launcher

    code = (
        "import os, signal, types\n"
        "from bert_mp.core.loop.state import stop_on_signals\n"
        "from bert_mp.core.process.launcher import relay_stop\n"
        "state = types.SimpleNamespace(pending_signal=None)\n"
        "with stop_on_signals(state, then_ignore=True):\n"
        "    if EARLY:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)  # the agent's, before the relay\n"
        "    relay_stop(state.pending_signal, 'signal SIGTERM')  # the launcher (this process) passes it back\n"
        "os.kill(os.getpid(), signal.SIGTERM)  # the agent's, after\n"
        "print('stopped line', state.pending_signal, flush=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    for early, pending in ((False, "None"), (True, "SIGTERM")):
        head = f"import os; os.environ[{launcher.LAUNCHER_PID_ENV!r}] = str(os.getpid()); EARLY = {early}\n"
        done = subprocess.run(
            [sys.executable, "-c", head + code], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, (early, done.returncode, done.stderr[-2000:])
        assert done.stdout == f"stopped line {pending}\n", early
