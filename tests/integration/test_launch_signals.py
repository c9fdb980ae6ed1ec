"""``bert-mp launch`` and ``accelerate launch`` through the real CLI: two CPU processes (gloo).

Ctrl-C and SIGTERM land on a run held after step 2 (``BERT_MP_HOLD``), so the order - running,
then signalled - holds at any machine speed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import (
    LAUNCH_DATA,
    LAUNCH_MODEL,
    free_port,
    hold_env,
    launch_env,
    launch_project,
    own_session,
    wait_held,
)

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
    ("sig", "to_group"), [(signal.SIGINT, True), (signal.SIGTERM, False)], ids=["ctrl-c", "SIGTERM"]
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
    proc = own_session(  # killed with its group when the test ends, however it ends
        subprocess.Popen(
            [sys.executable, "-m", "bert_mp", *args],
            cwd=project,
            env=launch_env(**hold_env("step:2", ready)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    )
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
