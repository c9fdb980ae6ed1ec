"""Every command of the README runs as written, in order, in a fresh copy of the repository.

The README's ```bash blocks are extracted and run one command at a time, except the ones that run
this test suite itself (``scripts/test.sh``) or the linters. Every command takes dotted overrides
(README: "Every command reads one typed config tree ... then dotted overrides"), so in the default
suite the training commands get the few below that shrink the corpus, the steps and the evaluation;
``-m slow`` runs them exactly as written (a few minutes on 2 cores, longer on a loaded machine).
``bash scripts/quickstart.sh`` and every line the shell must read run in bash; a plain ``bert-mp`` line
is forked from the suite's server (:data:`PLAIN`), except in the full run (``BERT_MP_TEST_FRESH=1``,
scripts/test.sh), where every command starts fresh, as a user's would.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
from support import ROOT

pytestmark = pytest.mark.fresh  # scripts/test.sh's full run starts every command fresh (tests/conftest.py)
SKIPPED = ("scripts/test.sh", "ruff ")
"""Commands that run the suite this test is part of, or the linters: not repeated from inside it."""
TRAINING = ("scripts/quickstart.sh", "bert-mp prepare", "bert-mp train", "bert-mp sweep")
TINY = [
    "data.max_documents=120",
    "data.vocab_size=512",
    "train.max_steps=4",
    "train.global_batch_size=8",
    "train.micro_batch_size=8",
    "train.warmup_steps=1",
    "train.log_every=2",
    "train.eval_every=2",
    "train.eval_max_batches=1",
    "train.save_every=2",
    "sweep.parity_window=2",
    "sweep.profile_steps=1",
]
TINY_FINETUNE = ["finetune.max_steps=4", "finetune.max_seq_length=32"]
PLAIN = re.compile(r"bert-mp( [A-Za-z0-9_./=,:+-]+)+")
"""A ``bert-mp`` command line without anything the shell would read (quotes, variables, redirections):
it runs as ``python -m bert_mp`` forked from a server that imported the libraries (tests/forkserver.py),
as the other CLI tests do; the rest (``bash scripts/quickstart.sh`` among them) runs in bash."""


def readme_commands(text: str) -> list[str]:
    """The command lines of the README's ```bash blocks, in order, comments and blank lines dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
            if line:
                commands.append(line)
    return commands


def fresh_copy(dest: Path) -> Path:
    """The repository's files as a clone has them (tracked and new, nothing git ignores)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def _env(venv: Path) -> dict[str, str]:
    env = {**os.environ, "BERT_MP_VENV": str(venv), "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def _with_overrides(command: str, tiny: bool) -> str:
    if not tiny:
        return command
    if any(t in command for t in TRAINING):
        return command + " " + " ".join(TINY)
    if command.startswith("bert-mp finetune"):
        return command + " " + " ".join(TINY_FINETUNE)
    return command


@pytest.mark.parametrize(
    "tiny", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["tiny", "as-written"]
)
def test_readme_commands_run_in_order_from_a_fresh_clone(tmp_path, tiny):
    venv = Path(sys.prefix)
    stamp = venv / ".bert_mp_installed"
    if not stamp.is_file():
        pytest.skip("needs the .venv that scripts/bootstrap.sh made (its install stamp is missing)")
    repo = fresh_copy(tmp_path / "clone")
    # as checked out before the install: bootstrap.sh must find the environment up to date, not reinstall
    before = stamp.stat().st_mtime - 1
    for name in ("pyproject.toml", "constraints.txt", "scripts/bootstrap.sh"):
        os.utime(repo / name, (before, before))
    commands = [
        c for c in readme_commands((repo / "README.md").read_text()) if not any(s in c for s in SKIPPED)
    ]
    assert any("quickstart.sh" in c for c in commands) and any(
        c.startswith("bert-mp predict") for c in commands
    )
    assert sum(PLAIN.fullmatch(c) is not None for c in commands) >= 6, commands
    env = _env(venv)
    if os.environ.get(forkserver.SWITCH_ENV, "1") != "0":  # BERT_MP_TEST_FORKSERVER=0: all run fresh
        forkserver.server_for(env)  # up front: most of the commands below are plain bert-mp lines
    for command in commands:
        line = _with_overrides(command, tiny)
        plain = PLAIN.fullmatch(line) is not None
        proc = forkserver.run(
            [sys.executable, "-m", "bert_mp", *line.split()[1:]]
            if plain
            else ["bash", "-c", f"set -euo pipefail; {line}"],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
            timeout=3600,
        )
        assert proc.returncode == 0, (
            f"README command failed: {command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    assert (repo / "runs" / "quickstart_sweep" / "report.md").is_file()
    assert (repo / "texts.csv.predictions" / "predictions.jsonl").is_file()
    assert shlex.split(commands[-1])[:2] == ["bert-mp", "config"]
