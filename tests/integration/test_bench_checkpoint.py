"""scripts/bench/checkpoint.py runs end to end at a toy size and writes every field of its JSON (no
timing is asserted)."""

from __future__ import annotations

import json
import sys

import forkserver
from support import ROOT


def test_bench_checkpoint_runs(tmp_path):
    out = tmp_path / "ckpt.json"
    cmd = [
        str(ROOT / "scripts" / "bench" / "checkpoint.py"),
        "--preset",
        "tiny",
        "--vocab",
        "512",
        "--repeat",
        "2",
    ]
    r = forkserver.run(  # forked from the suite's server (tests/forkserver.py)
        [sys.executable, *cmd, "--workdir", str(tmp_path), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    arms = {"hashed", "unhashed", "accelerate", "verify"}
    assert set(report["seconds"]) == set(report["cpu_seconds"]) == arms
    assert all(len(v) == 2 and all(x > 0 for x in v) for v in report["seconds"].values())
    sizes = report["checkpoint_bytes"]
    assert sizes["hashed"] == sizes["unhashed"] > 1_000_000  # the same bytes, hashed or not
    for key in (
        "checksum_cost_seconds",
        "checksum_cost_cpu_seconds",
        "hashed_over_unhashed",
        "verify_gb_per_s",
    ):
        assert isinstance(report[key], float), key
    assert list(tmp_path.iterdir()) == [out]  # every checkpoint it wrote is gone
