"""scripts/bootstrap.sh keeps pip's and setuptools' output in .venv/install.log, shown only on failure."""

import os
import subprocess
from pathlib import Path

from support import ROOT

FAKE_PYTHON = """#!/bin/sh
# stands in for the venv's python: "pip install" prints what setuptools prints on an editable install
echo "BuildBackendWarning: Editable installation." >&2
echo "Please be careful with folders in your working directory" >&2
exit ${FAKE_PIP_RC:-0}
"""


def _bootstrap(venv: Path, rc: int) -> subprocess.CompletedProcess:
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    env = {**os.environ, "BERT_MP_VENV": str(venv), "FAKE_PIP_RC": str(rc)}
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
