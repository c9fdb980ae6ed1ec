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


def test_help_config_report_and_a_config_mistake_load_no_model_library():
    """What needs no model answers without the ~5 CPU seconds of torch / transformers / datasets imports."""
    code = (
        "import contextlib, io, sys\n"
        "from bert_mp.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "    codes = [main(['config', 'train']), main(['train', 'train.precision=fp64'])]\n"
        "    try:\n"
        "        main(['predict', '--help'])\n"
        "    except SystemExit as e:\n"
        "        codes.append(e.code)\n"
        "import bert_mp.sweep.report  # bert-mp report reads JSON and draws: no model\n"
        "heavy = sorted({'torch', 'transformers', 'datasets', 'accelerate'} & set(sys.modules))\n"
        "print(codes, heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[0, 2, 0] []"
