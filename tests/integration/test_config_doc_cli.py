"""``bert-mp config`` and ``bert-mp train --help`` through the real CLI."""

from __future__ import annotations

import subprocess
import sys


def test_cli_config_and_help_pointer():
    run = [sys.executable, "-m", "bert_mp.cli"]
    proc = subprocess.run(
        [*run, "config", "data.max_seq_length"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.startswith("[data]\n  data.max_seq_length: int = 128")
    helptext = subprocess.run([*run, "train", "--help"], capture_output=True, text=True, timeout=120).stdout
    assert "bert-mp config" in helptext
