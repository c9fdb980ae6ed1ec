"""Run-folder guard through the real CLI: a used run folder is refused in one line before any work."""

from __future__ import annotations

import forkserver
import pytest


@pytest.mark.parametrize("command", ["train", "finetune"])
def test_cli_refuses_a_used_run_folder_in_one_line_before_any_work(tmp_path, command):
    import os
    import sys

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "kind": "train"}\n')
    before = sorted(p.name for p in run.rglob("*"))
    proc = forkserver.run(
        [
            sys.executable,
            "-m",
            "bert_mp",
            command,
            f"{command}.output_dir={run}",
            f"data.cache_dir={tmp_path / 'd'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert f"{command}.output_dir={run} already holds a run (metrics.jsonl, checkpoints)" in line
    assert sorted(p.name for p in run.rglob("*")) == before and not (tmp_path / "d").exists()
