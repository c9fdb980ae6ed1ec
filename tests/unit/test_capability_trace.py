"""The masked rerun's selection: every decision on the CPU's capabilities says where it was taken, and
scripts/test.sh reruns exactly those tests (or their modules) with every capability masked."""

from __future__ import annotations

import subprocess
import sys

import capability_trace as trace
import torch
from capability_trace import selection
from support import ROOT

from bert_mp.core.numerics import precision


def test_a_decision_is_traced_with_the_test_that_took_it_and_a_record_is_not(tmp_path, monkeypatch):
    trace = tmp_path / "trace"
    monkeypatch.setenv(precision.CAPS_TRACE_ENV, str(trace))
    precision.resolve_precision("fp32", precision.torch.device("cpu"))  # fp32 runs anywhere: no decision
    assert not trace.exists()
    precision.cpu_capabilities()
    here = "tests/unit/test_capability_trace.py::test_a_decision_is_traced_with_the_test_that_took_it"
    assert trace.read_text().startswith(here) and trace.read_text().endswith(" (call)\n")
    # a process the test starts inherits both variables, and its decision names the same test
    subprocess.run(
        [sys.executable, "-c", "from bert_mp.core.numerics import precision; precision.cpu_capabilities()"],
        check=True,
        cwd=ROOT,
    )
    assert trace.read_text().splitlines()[1] == trace.read_text().splitlines()[0]


def test_collection_time_decisions_are_traced_as_their_module(tmp_path, monkeypatch):
    trace = tmp_path / "trace"
    monkeypatch.setenv(precision.CAPS_TRACE_ENV, str(trace))
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    module = tmp_path / "test_asks.py"
    module.write_text("from bert_mp.core.numerics import precision\nCAPS = precision.cpu_capabilities()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    __import__("test_asks")
    assert trace.read_text() == "test_asks.py (collect)\n"


def test_selection_keeps_single_tests_and_widens_fixtures_and_collection_to_their_module():
    lines = [
        "tests/a.py::test_one[bf16] (call)",
        "tests/a.py::test_one[bf16] (call)",
        "tests/b.py::test_two (setup)",
        "tests/b.py::test_three (call)",
        "tests/c.py (collect)",
        "tests/d.py::TestX::test_four (teardown)",
        "",
    ]
    assert selection(lines) == ["tests/a.py::test_one[bf16]", "tests/b.py", "tests/c.py", "tests/d.py"]
    assert selection([]) == []


def test_the_masked_rerun_is_skipped_only_on_the_cpu_it_stands_for():
    from types import SimpleNamespace

    def caps(bf16=False, fp16=False, amx=False):
        return SimpleNamespace(bf16=bf16, fp16=fp16, amx=amx)

    assert trace.is_the_masked_cpu(caps(), "AVX2")  # an AVX2-only EPYC
    assert not trace.is_the_masked_cpu(caps(bf16=True), "AVX512")  # an AVX512-BF16 EPYC
    assert not trace.is_the_masked_cpu(caps(), "AVX512")  # AVX512 without bf16: other ATen kernels
    assert not trace.is_the_masked_cpu(caps(bf16=True, amx=True), "AVX2")  # ATEN_CPU_CAPABILITY=avx2 alone
    assert not trace.is_the_masked_cpu(caps(), "DEFAULT")  # no AVX2: the rerun's avx2 is not this CPU
    # scripts/test.sh asks the script itself: exit 0 for yes, 1 for no, as this process answers
    here = trace.is_the_masked_cpu(precision._probe_capabilities(), torch.backends.cpu.get_cpu_capability())
    script = [sys.executable, str(ROOT / "tests" / "capability_trace.py"), "--is-the-masked-cpu"]
    asked = subprocess.run(script, capture_output=True, text=True, cwd=ROOT)
    assert asked.returncode == (0 if here else 1) and asked.stderr == "", asked.stderr
