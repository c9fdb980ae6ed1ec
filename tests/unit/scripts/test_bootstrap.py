"""scripts/bootstrap.sh keeps pip's and setuptools' output in .venv/install.log, shown only on failure; it
installs against constraints.txt unless BERT_MP_UNLOCKED=1, and its stamp records which."""

import os
import subprocess
from pathlib import Path

from support import ROOT

FAKE_PYTHON = """#!/bin/sh
# stands in for the venv's python: "pip install" prints what setuptools prints on an editable install
echo "BuildBackendWarning: Editable installation." >&2
echo "Please be careful with folders in your working directory" >&2
echo "$*" >>"$(dirname "$0")/../calls"
exit ${FAKE_PIP_RC:-0}
"""


def _bootstrap(venv: Path, rc: int, **env_extra: str) -> subprocess.CompletedProcess:
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    env = {**os.environ, "BERT_MP_VENV": str(venv), "FAKE_PIP_RC": str(rc), **env_extra}
    for name in ("BERT_MP_UNLOCKED", "BERT_MP_TORCH"):
        if name not in env_extra:
            env.pop(name, None)
    return subprocess.run(
        ["bash", "-c", f"source {ROOT / 'scripts' / 'bootstrap.sh'}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_install_output_goes_to_the_log_and_shows_only_on_failure(tmp_path):
    ok = _bootstrap(tmp_path / "ok", 0)
    assert ok.returncode == 0, ok.stderr
    assert "Editable installation" not in ok.stdout + ok.stderr
    assert ok.stdout.strip() == "[bootstrap] installing dependencies (first run: a minute or two)"
    assert "Editable installation" in (tmp_path / "ok" / "install.log").read_text()
    assert (tmp_path / "ok" / ".bert_mp_installed").is_file()

    bad = _bootstrap(tmp_path / "bad", 1)
    assert bad.returncode != 0
    assert "Editable installation" in bad.stderr and "installation failed" in bad.stderr
    assert not (tmp_path / "bad" / ".bert_mp_installed").exists()


def test_the_install_is_locked_unless_asked_for_the_newest(tmp_path):
    assert _bootstrap(tmp_path / "lk", 0).returncode == 0
    calls = (tmp_path / "lk" / "calls").read_text().splitlines()
    installs = [c for c in calls if "install" in c and "--upgrade pip" not in c]
    assert len(installs) == 2 and all(f"-c {ROOT / 'constraints.txt'}" in c for c in installs), calls
    assert installs[0].endswith(" torch") and installs[1].endswith("-e .[dev]")
    assert (tmp_path / "lk" / ".bert_mp_installed").read_text().split() == ["locked", "torch="]

    assert _bootstrap(tmp_path / "new", 0, BERT_MP_UNLOCKED="1").returncode == 0
    calls = (tmp_path / "new" / "calls").read_text()
    assert "-c " not in calls and "--upgrade-strategy eager" in calls
    assert (tmp_path / "new" / ".bert_mp_installed").read_text().split() == ["unlocked", "torch="]

    # another torch: the lock without its torch line
    assert _bootstrap(tmp_path / "t", 0, BERT_MP_TORCH="torch==2.12.0").returncode == 0
    lock = (tmp_path / "t" / "constraints.txt").read_text()
    assert "torch==" not in lock.replace("torch-", "") and "numpy==" in lock
    assert f"-c {tmp_path / 't' / 'constraints.txt'} torch==2.12.0" in (tmp_path / "t" / "calls").read_text()
