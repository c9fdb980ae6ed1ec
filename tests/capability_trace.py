"""Which tests the masked rerun runs: the places ``BERT_MP_CAPS_TRACE`` recorded during the suite.

``scripts/test.sh`` runs the suite with ``BERT_MP_CAPS_TRACE=<file>`` (every decision that turns on the
CPU's capabilities appends where it was taken: ``bert_mp.core.numerics.precision``), then
``python tests/capability_trace.py <file>`` writes the pytest arguments of the rerun, one a line, for
``pytest @<args file>``: a test whose own body asked, or the whole module where a module fixture
(setup), a teardown or the module's collection asked, since every test of the module reads what
that decided. Measured on each run, so a new test that branches on the CPU is in the rerun at once.
"""

from __future__ import annotations

import sys
from pathlib import Path


def selection(lines: list[str]) -> list[str]:
    """Node ids and module paths to rerun, sorted; a module listed whole drops its single tests."""
    modules: set[str] = set()
    tests: set[str] = set()
    for line in lines:
        line = line.strip()
        if not line:
            continue
        where, _, phase = line.rpartition(" (")
        where = where or line
        if phase.rstrip(")") == "call" and "::" in where:
            tests.add(where)
        else:
            modules.add(where.split("::", 1)[0])
    tests = {t for t in tests if t.split("::", 1)[0] not in modules}
    return sorted(modules | tests)


MASKED_CAPABILITY = "AVX2"
"""ATen's kernels in the masked rerun (``ATEN_CPU_CAPABILITY=avx2`` in scripts/test.sh)."""


def is_the_masked_cpu(caps: object, aten_capability: str) -> bool:
    """Whether this CPU already is the one the masked rerun stands for: ATen's AVX2 kernels and no native
    bf16, fp16 or AMX (an AVX2-only EPYC). Then the suite's own run was that run, and the rerun would
    repeat it exactly."""
    return aten_capability == MASKED_CAPABILITY and not (caps.bf16 or caps.fp16 or caps.amx)


def main(argv: list[str]) -> int:
    if argv == ["--is-the-masked-cpu"]:  # exit 0: yes (scripts/test.sh then skips the rerun)
        import torch

        from bert_mp.core.numerics.precision import _probe_capabilities

        return 0 if is_the_masked_cpu(_probe_capabilities(), torch.backends.cpu.get_cpu_capability()) else 1
    if len(argv) != 1:
        print("usage: python tests/capability_trace.py TRACE_FILE | --is-the-masked-cpu", file=sys.stderr)
        return 2
    trace = Path(argv[0])
    lines = trace.read_text(encoding="utf-8").splitlines() if trace.is_file() else []
    for item in selection(lines):
        print(item)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
