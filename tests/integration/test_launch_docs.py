"""docs/usage.md's ``bert-mp launch`` example runs as written (two CPU processes), and a mistake the
ranks find is one line from one rank with exit 2, as without launch.

In the default suite the example gets overrides that shrink the corpus and the steps (never the batch
sizes: they are what the example is about) and a free rendezvous port, so suites that run side by
side on one machine do not meet on accelerate's default port; ``-m slow`` runs it exactly as written.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import ROOT, free_port

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")

SHRINK = [
    "data.max_documents=150",
    "data.vocab_size=512",
    "train.max_steps=2",
    "train.eval_max_batches=1",
    "train.save_every=2",
]


def docs_launch_examples() -> list[str]:
    """The runnable ``bert-mp launch`` lines of docs/usage.md's bash blocks (no placeholders)."""
    text = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            command = line.split(" #", 1)[0].strip()
            if command.startswith("bert-mp launch") and not re.search(r"\b[A-Z]{4,}\b", command):
                lines.append(command)
    return lines


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "bert_mp", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )


def _with_port(argv: list[str]) -> list[str]:
    """``launch --main_process_port N ...``: a port of its own (see the module docstring)."""
    return [argv[0], "--main_process_port", str(free_port()), *argv[1:]]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    return tmp_path


@pytest.mark.parametrize(
    "as_written", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["tiny", "as-written"]
)
def test_the_docs_launch_example_runs_with_two_processes(project, as_written):
    examples = docs_launch_examples()
    assert len(examples) == 1, examples
    argv = shlex.split(examples[0])[1:]  # after `bert-mp`
    if not as_written:
        argv = _with_port(argv) + SHRINK
    proc = _run(argv, project)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr
    out = dict(a.split("=", 1) for a in argv if a.startswith("train.output_dir="))["train.output_dir"]
    summary = (project / out / "summary.json").read_text()
    assert '"processes": 2' in summary and '"status": "completed"' in summary


def test_a_batch_the_ranks_cannot_split_is_one_line_from_one_rank_and_exit_2(project):
    """The example without its micro-batch: each rank finds the mistake; one line says it, with the fix."""
    argv = _with_port(["launch", "--num_processes", "2", "train", "configs/quickstart.yaml", *SHRINK])
    proc = _run(argv, project)
    assert proc.returncode == 2, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.stderr == (
        "bert-mp train: error: train.global_batch_size=32 must be a multiple of train.micro_batch_size (32) "
        "x processes (2); with 2 processes set train.micro_batch_size=16 (accumulation 1), or change "
        "train.global_batch_size\n"
    ), proc.stderr
    assert not (project / "runs").exists()
