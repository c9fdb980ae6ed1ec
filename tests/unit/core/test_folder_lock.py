"""One writer per run folder: an OS lock held for the writer's life, a second command refused in one
line naming the holder, a dead holder's folder taken over, a file system that cannot lock said once."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import warnings

import pytest
from support import TESTS

from bert_mp.core.process import run_dir
from bert_mp.core.storage import folder_lock
from bert_mp.errors import BertMPWarning

HOLDER = (
    "import sys; sys.path.insert(0, sys.argv[2]); from bert_mp.core.storage import folder_lock as f; "
    "lock = f.take(sys.argv[1], f.me(launcher_pid=4242)); print('held', flush=True); sys.stdin.read()"
)


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_live_holder_is_named_and_a_killed_one_is_taken_over(tmp_path):
    """A process holds the folder: a second taker is refused with its record (host, pid, command,
    since, its launcher), the folder unchanged; SIGKILL the holder and the folder is taken at once."""
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run), str(TESTS.parent)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"  # it holds the lock from here on
        before = _files(run)
        with pytest.raises(folder_lock.FolderInUse) as refused:
            folder_lock.take(run, folder_lock.me())
        h = refused.value.holder
        assert (h.pid, h.host, h.launcher_pid, h.stop_pid) == (holder.pid, socket.gethostname(), 4242, 4242)
        assert h.command.startswith(f"{sys.executable} -c ") and h.since[:2] == "20"
        line = run_dir.busy_line(run, "train.output_dir", h)
        assert line.startswith(f"train.output_dir={run} is in use by another run: pid {holder.pid} on ")
        assert "under bert-mp launch pid 4242" in line and "kill -TERM 4242" in line and "\n" not in line
        assert _files(run) == before  # the refused taker wrote nothing
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate(timeout=60)
    with folder_lock.take(run, folder_lock.me()) as lock:  # the kernel freed the dead holder's lock
        assert folder_lock.read_holder(lock.path).pid == os.getpid()
    assert not (run / folder_lock.LOCK_FILE).exists()  # let go: nothing left behind


def test_the_run_guard_refuses_a_held_folder_before_any_work_in_one_line(tmp_path, capfd):
    """``bert-mp train`` and ``bert-mp finetune`` into a folder another process holds: one line naming
    the key and the holder, exit 2, before any work (no data prepared, nothing written)."""
    from bert_mp.cli import main

    for command in ("train", "finetune"):
        run = tmp_path / command
        with folder_lock.take(run, folder_lock.me()):
            before = _files(run)
            code = main([command, f"{command}.output_dir={run}", f"data.cache_dir={tmp_path / 'd'}"])
            assert _files(run) == before
        (line,) = capfd.readouterr().err.splitlines()
        assert code == 2 and line.startswith(
            f"bert-mp {command}: error: {command}.output_dir={run} is in use"
        )
        assert f"pid {os.getpid()} on {socket.gethostname()}" in line
    assert not (tmp_path / "d").exists()


def test_a_sweep_holds_its_own_folder(tmp_path, capfd):
    """A second sweep into a held sweep folder is refused in one line (its runs' `bert-mp train`
    hold their own folders under runs/, so the sweep's lock never blocks them)."""
    from bert_mp.cli import main

    root = tmp_path / "sweep"
    with folder_lock.take(root, folder_lock.me()):
        code = main(["sweep", "configs/quickstart_sweep.yaml", f"sweep.output_dir={root}"])
    (line,) = capfd.readouterr().err.splitlines()
    assert code == 2 and line.startswith(
        f"bert-mp sweep: error: sweep.output_dir={root} is in use by another sweep"
    )


def test_a_file_system_that_cannot_lock_is_said_once_and_the_command_goes_on(tmp_path, monkeypatch):
    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(folder_lock.fcntl, "flock", no_locks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with run_dir.hold_folder(tmp_path / "run", "train.output_dir"):
            ran = True
    said = [str(w.message) for w in caught if issubclass(w.category, BertMPWarning)]
    assert ran and len(said) == 1, said
    assert said[0].startswith(f"train.output_dir={tmp_path / 'run'}: this file system cannot lock files")
    assert "No locks available (ENOLCK)" in said[0]


def test_only_the_main_process_holds_and_letting_go_leaves_a_new_folder_as_it_was(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with run_dir.hold_folder(tmp_path / "a", "train.output_dir"):
        assert not (tmp_path / "a").exists()  # rank 0 holds the folder, not this rank
    monkeypatch.setenv("RANK", "0")
    with run_dir.hold_folder(tmp_path / "b", "train.output_dir"):
        assert (tmp_path / "b" / folder_lock.LOCK_FILE).is_file()
    assert not (tmp_path / "b").exists()  # created for the lock, nothing else written: removed


def test_a_file_where_the_folder_should_be_is_one_line_naming_the_key(tmp_path):
    from bert_mp.errors import ConfigError

    (tmp_path / "run").write_text("not a folder")
    with (
        pytest.raises(
            ConfigError, match=r"^train.output_dir=.*/run: cannot hold it as a run folder \(\[Errno 17\]"
        ),
        run_dir.hold_folder(tmp_path / "run", "train.output_dir"),
    ):
        pass


def test_a_refused_or_failed_command_leaves_the_folders_as_it_found_them(tmp_path):
    """The run guard's refusals come before a lock file is made where there is none (the folder's
    own mtime unchanged); folders made for the lock go again with it; ``release_all`` (before an
    ``os._exit``) lets go of every folder held."""
    from bert_mp.errors import ConfigError

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    before = run.stat().st_mtime_ns

    def refuse() -> None:
        raise ConfigError("train.output_dir=run already holds a run")

    with pytest.raises(ConfigError), run_dir.hold_folder(run, "train.output_dir", check=refuse):
        pass
    assert run.stat().st_mtime_ns == before and sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]
    with pytest.raises(RuntimeError), run_dir.hold_folder(tmp_path / "runs" / "a" / "b", "train.output_dir"):
        raise RuntimeError("a mistake found after the lock")
    assert not (tmp_path / "runs").exists()
    held = folder_lock.take(tmp_path / "c", folder_lock.me())
    folder_lock.release_all()
    assert held.fd is None and not (tmp_path / "c").exists()


def test_a_waiter_says_whom_it_waits_for_once_and_takes_the_lock_when_it_is_free(tmp_path, monkeypatch):
    held = folder_lock.take(tmp_path / "f", folder_lock.me())
    told = []
    with pytest.raises(folder_lock.FolderInUse) as e:  # a time limit: the holder is still there
        folder_lock.take_waiting(tmp_path / "f", folder_lock.me(), 0.3, told.append)
    assert e.value.holder == told[0] == folder_lock.read_holder(tmp_path / "f" / folder_lock.LOCK_FILE)
    assert len(told) == 1 and told[0].pid == os.getpid()
    tries = []

    def take_then_let_go(folder, holder):  # the holder lets go while the waiter waits
        tries.append(folder)
        if len(tries) == 2:
            held.release()  # removes the lock file and the folder it made, under the waiter
        return take(folder, holder)

    take = folder_lock.take
    monkeypatch.setattr(folder_lock, "take", take_then_let_go)
    told.clear()
    lock = folder_lock.take_waiting(tmp_path / "f", folder_lock.me(), None, told.append)
    assert lock.fd is not None and len(told) == 1 and len(tries) >= 2
    lock.release()
    assert not (tmp_path / "f").exists()
