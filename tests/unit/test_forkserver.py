"""The suite's fork server (tests/forkserver.py): a command it runs says, writes and exits exactly as
the same command in a fresh interpreter, and whatever it cannot run faithfully runs fresh."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get(forkserver.SWITCH_ENV, "1") == "0", reason=f"{forkserver.SWITCH_ENV}=0: nothing is forked"
)
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _both(args: list[str], cwd) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    cmd = [sys.executable, "-m", "bert_mp", *args]
    forkserver.server_for(ENV)
    proc = forkserver.popen(cmd, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert isinstance(proc, forkserver.ForkedProcess), (
        "not forked: the comparison would be fresh against fresh"
    )
    out, err = proc.communicate(timeout=300)
    forked = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    fresh = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)
    return forked, fresh


@pytest.mark.parametrize(
    "args",
    [
        ["config", "train.precision"],  # exit 0, stdout only
        ["train", "nosuch=1", "data.cache_dir=d"],  # exit 2, one line on stderr, nothing written
        ["report", "no/such/sweep"],
    ],
)
def test_a_forked_command_says_writes_and_exits_as_a_fresh_one(tmp_path, args):
    before = forkserver.CPU_SECONDS
    forked, fresh = _both(args, tmp_path)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert before < forkserver.CPU_SECONDS  # the child's CPU seconds reach the suite's CPU report
    assert list(tmp_path.iterdir()) == []


def test_a_forked_command_has_its_own_process_session_and_exit_status(tmp_path):
    forkserver.server_for(ENV)
    proc = forkserver.popen(
        [sys.executable, "-m", "bert_mp", "config", "train"],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    assert isinstance(proc, forkserver.ForkedProcess)
    assert proc.pid not in (os.getpid(), *(s.proc.pid for s in forkserver._SERVERS.values()))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and b"train.precision" in out and err is None


def test_what_a_server_cannot_run_faithfully_runs_fresh():
    for args in (["--debug", "config"], ["launch", "--help"]):  # full tracebacks; a launcher
        proc = forkserver.popen([sys.executable, "-m", "bert_mp", *args], env=ENV, stdout=subprocess.DEVNULL)
        assert type(proc) is subprocess.Popen and proc.wait(timeout=300) == 0
    proc = forkserver.popen([sys.executable, "-c", "pass"], env=ENV)  # not a bert_mp command
    assert type(proc) is subprocess.Popen and proc.wait(timeout=300) == 0
    debug = {**ENV, "BERT_MP_DEBUG": "1"}
    proc = forkserver.popen(
        [sys.executable, "-m", "bert_mp", "config", "train"], env=debug, stdout=subprocess.DEVNULL
    )
    assert type(proc) is subprocess.Popen and proc.wait(timeout=300) == 0


def test_a_server_whose_imports_print_is_not_used():
    """Python's import trace on stderr stands for any library that speaks at import: a fresh process
    would print it, a forked child could not, so the server refuses and its commands run fresh."""
    env = {**ENV, "PYTHONVERBOSE": "1"}
    with pytest.warns(UserWarning, match="fork server not used, its commands run fresh: the imports printed"):
        server = forkserver.server_for(env)
    assert server.problem and server.problem.startswith("the imports printed")
    proc = forkserver.popen(
        [sys.executable, "-m", "bert_mp", "config", "train"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert type(proc) is subprocess.Popen
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and b"import " in err


def test_a_child_environment_is_the_command_s_plus_what_the_imports_set():
    """Variables the imports set (quiet_libraries' defaults, the oneDNN cap of BERT_MP_CPU_MASK) are
    applied as the imports would have; the command's own values of the runtime-only ones stay."""
    job = {"PATH": "/bin", "BERT_MP_HOLD": "step:2", "TRANSFORMERS_VERBOSITY": "error", "GONE": "1"}
    delta = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI", "TRANSFORMERS_VERBOSITY": "error"}
    assert forkserver.child_environment(job, delta, ["GONE"]) == {
        "PATH": "/bin",
        "BERT_MP_HOLD": "step:2",
        "TRANSFORMERS_VERBOSITY": "error",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
    }


def test_the_import_environment_keys_the_server():
    base = {"PATH": "/bin", "HF_HOME": "/h"}
    key = forkserver.import_key
    assert key({**base, "BERT_MP_HOLD": "step:1", "PYTEST_CURRENT_TEST": "t (call)"}) == key(base)
    assert key({**base, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "60"}) == key(base)  # a sweep's runs
    assert key({**base, "DS_ACCELERATOR": "cpu"}) == key(base)  # read when DeepSpeed is imported
    # quiet_libraries() sets its defaults before any import: having them already changes nothing
    assert key({**base, "TRANSFORMERS_VERBOSITY": "error"}) == key(base)
    assert key({**base, "TRANSFORMERS_VERBOSITY": "info"}) != key(base)
    assert key({**base, "BERT_MP_CPU_MASK": "all"}) != key(base)  # read at import (the oneDNN cap)
    assert key({**base, "HF_HOME": "/other"}) != key(base)  # a library's import-time setting


def test_a_server_removes_its_folder_when_it_ends_even_without_its_worker(tmp_path):
    """A pytest worker that is killed cannot remove its servers' folders; each server removes its own
    when it ends (here a refused one, which ends at once; a serving one ends when its stdin closes)."""
    folder = tmp_path / "server"
    folder.mkdir()
    env = {**ENV, "PYTHONVERBOSE": "1"}  # the imports print: refused after its first import
    proc = subprocess.Popen(
        [sys.executable, forkserver.__file__, str(folder / "socket")],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=folder,
    )
    ready = json.loads(proc.stdout.readline())
    assert ready["problem"].startswith("the imports printed")
    proc.stdout.close()
    proc.stdin.close()  # as when its worker is gone
    assert proc.wait(timeout=300) == 0
    assert not folder.exists()


PROBE = """from bert_mp.core.process.noise import quiet_libraries

quiet_libraries()
import json, sys
import torch
print(json.dumps([sys.argv, __file__, sys.path[0], __name__, torch.__name__]))
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


def test_a_forked_script_sees_what_a_fresh_one_sees(tmp_path, monkeypatch):
    """A script of scripts/ that calls quiet_libraries() before its imports is forked: its argv,
    ``__file__``, first path entry, name, output and exit status are a fresh interpreter's."""
    monkeypatch.setattr(forkserver, "SCRIPTS", tmp_path)  # the probe stands in for one of scripts/
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    cmd = [sys.executable, str(script), "--flag", "x y"]
    cwd = tmp_path / "elsewhere"  # the script's folder, not the working one, is first on the path
    cwd.mkdir()
    forkserver.server_for(ENV)
    forked = forkserver.popen(cmd, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert isinstance(forked, forkserver.ForkedProcess)
    out, err = forked.communicate(timeout=300)
    fresh = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, timeout=300)
    assert (
        (forked.returncode, out, err)
        == (fresh.returncode, fresh.stdout, fresh.stderr)
        == (3, *_probe(script))
    )


def _probe(script) -> tuple[bytes, bytes]:
    said = [[str(script), "--flag", "x y"], str(script), str(script.parent), "__main__", "torch"]
    return (json.dumps(said) + "\n").encode(), b"to stderr\n"


def test_only_the_repositorys_quiet_scripts_are_forked(tmp_path):
    outside = tmp_path / "quiet.py"
    outside.write_text(PROBE)
    assert forkserver._script_args([sys.executable, str(outside)]) is None  # not one of scripts/
    loud = [p for p in forkserver.SCRIPTS.rglob("*.py") if forkserver.QUIET_CALL not in p.read_text()]
    quiet = forkserver.SCRIPTS / "bench" / "train.py"
    assert loud and forkserver._script_args([sys.executable, str(loud[0]), "-h"]) is None
    assert forkserver._script_args([sys.executable, str(quiet), "-h"]) == (str(quiet), ["-h"])
    assert forkserver._script_args([sys.executable, "-c", "pass"]) is None


def test_the_full_run_starts_the_commands_of_signals_and_readme_tests_fresh(monkeypatch):
    """scripts/test.sh sets BERT_MP_TEST_FRESH=1: a test marked ``signals`` or ``fresh`` then runs with
    the fork server off (tests/conftest.py); other tests, and every test without it, fork."""
    import types

    import conftest

    def node(*marks: str):
        return types.SimpleNamespace(get_closest_marker=lambda name: name if name in marks else None)

    monkeypatch.setenv(conftest.FRESH_ENV, "1")
    assert conftest.commands_fresh(node("signals")) and conftest.commands_fresh(node("fresh", "slow"))
    assert not conftest.commands_fresh(node()) and not conftest.commands_fresh(node("slow"))
    monkeypatch.delenv(conftest.FRESH_ENV)
    assert not conftest.commands_fresh(node("signals"))
    readme_test = Path(conftest.__file__).parent / "integration" / "test_readme_commands.py"
    assert "pytestmark = pytest.mark.fresh" in readme_test.read_text()  # the README's commands
