"""scripts/gpu/check.py in this process: what each phase measured, read from what its child wrote; a
phase cut at its share of the budget keeps its rows, and one cut with nothing written is a hang, which
fails the check's rehearsal (the whole dry run: tests/integration/test_gpu_check_rehearsal.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support import ROOT, load_script

check = load_script("gpu/check")


def test_a_phase_cut_after_its_rows_keeps_them_and_one_cut_with_none_hung(tmp_path):
    found = tmp_path / "bench.json"  # what a child wrote before the machine's slowness cut it
    found.write_text(json.dumps({"results": {"bert_mp_fp32": {"tokens_per_sec": 10.0}, "note": "x"}}))
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]  # never finishes by itself
    with open(tmp_path / "log", "w") as log:
        cut = check.run_phase("bench", sleeper, found, 0.1, tmp_path, log)
        hung = check.run_phase("sweep", sleeper, tmp_path / "nothing", 0.1, tmp_path, log)
    assert cut["status"] == hung["status"] == "timeout" and (cut["rows"], hung["rows"]) == (1, 0)
    written = json.loads((tmp_path / "bench.json").read_text())
    assert (
        written["measured"] == {"bert_mp_fp32": {"tokens_per_sec": 10.0}} and written["status"] == "timeout"
    )
    for name in ("summary.json", "check.log", "tests.json"):
        (tmp_path / name).write_text(json.dumps({"status": "ok", "rows": 1}))
    verdict = check.judge(tmp_path, ["tests", "bench", "sweep"], rc=1)
    assert verdict["hung"] == ["sweep"] and not verdict["ok"] and verdict["rows"]["bench"] == 1
    assert check.judge(tmp_path, ["tests", "bench"], rc=1)["hung"] == []  # a cut with rows: no hang
    assert check.judge(tmp_path, ["tests", "kernels"], rc=0)["missing"] == ["kernels.json"]


def test_a_phase_that_ends_is_ok_or_failed_by_its_exit_code(tmp_path):
    with open(tmp_path / "log", "w") as log:
        ok = check.run_phase("bench", [sys.executable, "-c", "pass"], tmp_path / "x", 60, tmp_path, log)
        bad = check.run_phase(
            "bench", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "x", 60, tmp_path, log
        )
    assert (ok["status"], bad["status"]) == ("ok", "failed")


def test_tests_are_counted_from_the_junit_report(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="a" name="t1"/><testcase classname="a" name="t2">'
        '<failure message="boom"/></testcase><testcase classname="a" name="t3"><skipped/></testcase>'
        '<testcase classname="a" name="t4"><error message="e"/></testcase></testsuite></testsuites>'
    )
    measured = check.rows("tests", junit)
    assert measured == {"passed": 1, "skipped": 1, "failed": ["a::t2", "a::t4"]}
    assert check.count("tests", measured) == 3
    junit.unlink()  # cut before pytest wrote its report: counted from its verbose lines
    assert check.rows("tests", junit) == {}
    (tmp_path / "tests.log").write_text(
        "collected 3 items\n\ntests/a.py::t1 PASSED   [ 33%]\ntests/a.py::t2[x] FAILED [ 66%]\n"
        "tests/a.py::t3 SKIPPED (needs a CUDA device) [100%]\n"
    )
    assert check.rows("tests", junit) == {"passed": 1, "skipped": 1, "failed": ["tests/a.py::t2[x]"]}


def test_sweep_runs_and_verdicts_are_read_from_the_sweep_folder(tmp_path):
    run = tmp_path / "runs" / "fp32"
    run.mkdir(parents=True)
    run.joinpath("summary.json").write_text(
        json.dumps({"status": "completed", "steps": 4, "throughput": {"tokens_per_sec": 5.0, "mfu": 0.3}})
    )
    (tmp_path / "runs" / "bf16").mkdir()  # started, nothing written yet
    measured = check.rows("sweep", tmp_path)
    assert measured["runs"]["fp32"]["tokens_per_sec"] == 5.0 and measured["verdicts"] == {}
    tmp_path.joinpath("summary.json").write_text(
        json.dumps({"groups": [{"name": "default", "verdicts": {"bf16": {"status": "pass"}}}]})
    )
    assert check.rows("sweep", tmp_path)["verdicts"] == {"default/bf16": "pass"}
    assert check.count("sweep", measured) == 1


def test_docstring_corpus_is_real_text_the_same_on_every_run(tmp_path):
    src = tmp_path / "pkg"
    src.mkdir()
    (src / "a.py").write_text(
        '"""A module docstring long enough to be kept as text here."""\ndef f():\n    """short"""\n'
    )
    (src / "b.py").write_text("def broken(:\n")
    info = check.write_docstring_corpus(tmp_path / "out", 10_000, [src])
    assert info == {
        "bytes": len("A module docstring long enough to be kept as text here.\n\n"),
        "documents": 1,
    }
    assert (tmp_path / "out" / "corpus.txt").read_text().startswith("A module docstring")


@pytest.mark.parametrize("args", [["--phases", "tests,kernels"], ["--budget", "0"], ["--wheels"]])
def test_a_bad_option_is_one_line_and_exit_2(tmp_path, args):
    r = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(tmp_path), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 2 and "error: " in r.stderr.splitlines()[-1] and "--" in r.stderr, r.stderr
    assert not any(tmp_path.iterdir())  # refused before any work
