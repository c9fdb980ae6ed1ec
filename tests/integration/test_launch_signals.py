"""``bert-mp launch`` and ``accelerate launch`` through the real CLI: two CPU processes (gloo).

Ctrl-C and SIGTERM land on a run held after step 2 (``BERT_MP_HOLD``), so the order - running,
then signalled - holds at any machine speed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file
from support import (
    LAUNCH_DATA,
    LAUNCH_MODEL,
    all_ended,
    free_port,
    hold_env,
    launch_env,
    launch_project,
    launch_ranks,
    run_cli,
    start_cli,
    wait_held,
)

from bert_mp.core.storage.files import read_jsonl

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")

TRAIN = [
    *LAUNCH_DATA,
    *LAUNCH_MODEL,
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.eval_max_batches=1",
    "train.progress_bar=false",
]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """corpus/a.txt, tok/ and the prepared data/<key>/ (the runs reuse it)."""
    return launch_project(tmp_path_factory.mktemp("launch"))


def _port() -> str:
    return str(free_port())


@pytest.mark.signals
@pytest.mark.parametrize(
    ("sig", "to_group"),
    [
        (signal.SIGINT, True),
        # -m slow: a SIGTERM to a launcher, 143 and the stopped line once are asserted by
        # test_launch_machines.py (one machine's launcher) and its FSDP launch
        pytest.param(signal.SIGTERM, False, marks=pytest.mark.slow),
    ],
    ids=["ctrl-c", "SIGTERM"],
)
def test_launch_two_processes_stops_on_a_signal_with_its_exit_code_and_one_line(project, sig, to_group):
    """``bert-mp launch --num_processes 2 train``: two processes run; Ctrl-C (to the terminal's
    process group) or SIGTERM (to the command) saves a checkpoint and exits 130 / 143 with the run's
    stopped line - printed once, by the main process - and no traceback (accelerate launch itself
    exits 1 with torch elastic's SignalException traceback)."""
    out = f"run_{sig.name}"
    ready = project / f"held_{sig.name}"
    args = ["launch", "--num_processes", "2", "--main_process_port", _port(), "train", *TRAIN]
    args += [f"train.output_dir={out}", "train.max_steps=100000"]
    proc = start_cli(*args, cwd=project, env=launch_env(**hold_env("step:2", ready)))
    wait_held(proc, ready)
    if to_group:
        os.killpg(proc.pid, sig)  # a terminal's Ctrl-C
    else:
        os.kill(proc.pid, sig)  # a job scheduler's SIGTERM
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + sig, (stdout[-3000:], stderr[-3000:])
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr[-3000:]
    summary = json.loads((project / out / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["stop_reason"] == f"signal {sig.name}"
    assert summary["batch"]["processes"] == 2
    said = [line for line in stdout.splitlines() if line.startswith("bert-mp ")]
    stopped = f"bert-mp train: stopped after {summary['steps']} steps (signal {sig.name}; checkpoint saved)"
    resume = "continue it with the same command and train.resume=latest"
    assert [line for line in said if line.startswith(stopped)] == [f"{stopped} -> {out}; {resume}"], stdout
    assert len(said) == len(set(said)), said  # the second process prints nothing of its own
    assert sum(line.startswith("bert-mp prepare: reusing") for line in said) == 1
    saved = sorted(p.name for p in (project / out / "checkpoints").iterdir())
    assert saved == [f"step_{summary['steps']:08d}"]


def test_accelerate_launch_cpu_with_two_processes_says_that_one_runs(project):
    """A plain ``accelerate launch --cpu --num_processes 2`` starts one process (Accelerate 1.x): the
    run says so, once, and names what starts two."""
    args = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2"]
    args += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    args += ["-m", "bert_mp", "train", *TRAIN, "train.output_dir=one", "train.max_steps=1"]
    proc = subprocess.run(args, cwd=project, env=launch_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [line for line in proc.stderr.splitlines() if "was asked for 2 processes" in line]
    assert len(warned) == 1 and warned[0].startswith("bert-mp train: warning: accelerate launch"), proc.stderr
    assert "bert-mp launch --num_processes 2" in warned[0]
    assert json.loads((project / "one" / "summary.json").read_text())["batch"]["processes"] == 1


def test_launch_checks_the_config_before_any_process_starts(project):
    args = ["launch", "--num_processes", "2", "train", *TRAIN, "train.output_dir=never", "train.max_step=3"]
    proc = subprocess.run(
        [sys.executable, "-m", "bert_mp", *args],
        cwd=project,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("bert-mp launch: error: train.max_step") and not (project / "never").exists()


# --------------------------------------------------------------------------------------------------
# one writer per run folder; a killed launcher; a killed rank: one run, stopped twice, resumed exactly
# --------------------------------------------------------------------------------------------------
CHAIN = [*TRAIN, "model.hidden_dropout_prob=0", "model.attention_probs_dropout_prob=0"]
CHAIN += ["train.max_steps=8", "train.save_every=2"]
"""Dropout off: one process draws other dropout masks than two; the resumes are exact either way."""


def _launch(project: Path, out: str, *extra: str, env: dict | None = None) -> subprocess.Popen:
    """``bert-mp launch --num_processes 2 train ...`` of 8 steps, a checkpoint every 2, into ``out``."""
    args = ["launch", "--num_processes", "2", "--main_process_port", _port(), "train", *CHAIN]
    # its group is killed when the test ends (its ranks, in sessions of their own, by the test: _ranks)
    return start_cli(*args, f"train.output_dir={out}", *extra, cwd=project, env=env or launch_env())


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def _rows(folder: Path, key: str = "loss/total", kind: str = "train") -> list:
    return [(r["step"], r[key]) for r in read_jsonl(folder / "metrics.jsonl") if r["kind"] == kind]


@pytest.fixture(scope="module")
def straight(project) -> Path:
    """The same 8 steps without interruption: the weights every resume must end with."""
    proc = _launch(project, "straight")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, (out[-2000:], err[-3000:])
    return project / "straight"


def test_two_processes_train_like_one_with_the_same_global_batch(project, straight, monkeypatch):
    """The 2-process launch against one process (in this process) accumulating 2 micro-batches of 4:
    the losses, the evaluation and the weights agree to fp32 round-off (the summation order)."""
    from bert_mp.core.config import load_config
    from bert_mp.pretrain.trainer import train

    monkeypatch.chdir(project)
    summary = train(load_config(None, [*CHAIN, "train.output_dir=single"]))
    assert summary["batch"]["processes"] == 1 and summary["batch"]["accumulation"] == 2
    assert json.loads((straight / "summary.json").read_text())["batch"]["accumulation"] == 1
    one, two = project / "single", straight
    assert [s for s, _ in _rows(one)] == list(range(1, 9))
    assert [v for _, v in _rows(two)] == pytest.approx([v for _, v in _rows(one)], rel=1e-5, abs=1e-6)
    evals = [_rows(f, "eval/loss_mlm", "eval") for f in (one, two)]
    assert [v for _, v in evals[1]] == pytest.approx([v for _, v in evals[0]], rel=1e-5)
    a, b = (
        load_file(str(one / "final" / "model.safetensors")),
        load_file(str(two / "final" / "model.safetensors")),
    )
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)


@pytest.mark.signals
def test_a_killed_launcher_then_a_killed_rank_stop_cleanly_and_the_run_resumes_to_the_same_weights(
    project, straight, monkeypatch, capfd
):
    """1. Held after step 3: a second `bert-mp train` into the live folder is refused in one line
    naming the holder (exit 2, nothing touched); then `bert-mp launch` is SIGKILLed: both ranks see it
    at the next step's boundary, finish step 4, save it together and record ``launcher gone``.
    2. The resume, held after step 6 (checkpoint 6 saved): rank 1 is SIGKILLed; the launch ends with
    one line naming rank 1, SIGKILL, the step, the last checkpoint and the command that continues the
    run, exit 5; no traceback shown, all of it in the run folder's launch.log. 3. That command
    finishes the run with the uninterrupted run's losses and weights, to the bit."""
    from bert_mp.cli import main
    from bert_mp.core.checkpoint import store as ckpt

    run, started = project / "chain", []
    try:
        ready = project / "held_chain"
        first = _launch(project, "chain", env=launch_env(**hold_env("step:3", ready)))
        wait_held(first, ready)
        ranks = launch_ranks(first, started)
        before = _files(run)
        with monkeypatch.context() as m:  # `bert-mp train` (its CLI, in this process) into the live folder
            m.chdir(project)
            capfd.readouterr()
            assert main(["train", *CHAIN, "train.output_dir=chain", "train.resume=latest"]) == 2
        (line,) = capfd.readouterr().err.splitlines()
        assert line.startswith(
            f"bert-mp train: error: train.output_dir=chain is in use by another run: pid {ranks[0].pid} on "
        )
        assert f"under bert-mp launch pid {first.pid}" in line and f"kill -TERM {first.pid}" in line
        assert _files(run) == before  # the live run's files untouched
        os.kill(first.pid, signal.SIGKILL)  # bert-mp launch dies; its launcher and ranks live on
        first.wait(timeout=60)  # dead (SIGKILL lands a little after kill() returns), reaped
        ready.unlink()  # rank 0 goes on and finds its launcher gone at the next step's boundary
        out, _ = first.communicate(timeout=300)  # the ranks and their launcher hold its stdout until they end
        summary = json.loads((run / "summary.json").read_text())
        assert (summary["status"], summary["stop_reason"], summary["steps"]) == (
            "stopped",
            "launcher gone",
            4,
        )
        assert "bert-mp train: stopped after 4 steps (launcher gone; checkpoint saved)" in out
        saved = [p.name for p in ckpt.list_checkpoints(run / "checkpoints")]
        assert (
            saved == ["step_00000002", "step_00000004"]
            and ckpt.verify(run / "checkpoints" / saved[-1]) is None
        )
        assert all_ended(started, timeout=120)  # they closed its stdout and now end: none trains on

        ready = project / "held_chain_2"
        resumed = _launch(
            project, "chain", "train.resume=latest", env=launch_env(**hold_env("step:6", ready))
        )
        wait_held(resumed, ready)
        victim = launch_ranks(resumed, started)[1]
        victim.send_signal(signal.SIGKILL)  # as the out-of-memory killer does
        ready.unlink()  # rank 0's next collective fails; torch elastic ends the launch
        _, err = resumed.communicate(timeout=300)
        assert resumed.returncode == 5, err[-3000:]
        (line,) = err.splitlines()
        assert (
            line.startswith(f"bert-mp launch: error: rank 1 (pid {victim.pid} on ") and "Traceback" not in err
        )
        assert "was killed by SIGKILL" in line and "after step 6 (the last one logged)" in line
        assert "the last checkpoint saved is chain/checkpoints/step_00000006" in line
        assert ckpt.verify(run / "checkpoints" / "step_00000006") is None
        assert line.endswith(f"what the ranks and the launcher wrote: {run / 'launch.log'}")
        kept = (run / "launch.log").read_text()
        assert "ChildFailedError" in kept and "exitcode  : -9" in kept

        command = shlex.split(line.split("continue the run with `")[1].split("`")[0])
        assert command[:2] == ["bert-mp", "launch"] and command[-1] == "train.resume=latest"
        last = run_cli(*command[1:], cwd=project, env=launch_env())  # one thread a rank, as the others
        assert last.returncode == 0, last.stderr[-3000:]
    finally:
        for p in started:
            with contextlib.suppress(psutil.Error):
                p.kill()
    assert _rows(run) == _rows(straight)  # every step's loss, to the bit
    a, b = (
        load_file(str(straight / "final" / "model.safetensors")),
        load_file(str(run / "final" / "model.safetensors")),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
