#!/usr/bin/env bash
# Install what is needed into .venv and run the test suite. With no arguments: the whole suite, then
# every test that took a decision on this CPU's capabilities again as on the weakest supported CPU
# (no bf16, no fp16, no AMX, ATen's AVX2 kernels), so a pass here means a pass on any CPU model (on
# such a CPU the whole suite already ran so: the rerun is skipped).
# Extra arguments go to one pytest run instead, e.g. `bash scripts/test.sh -m slow`, or one part of
# the suite: `bash scripts/test.sh tests/unit` (in-process, per package: tests/unit/data, ...) or
# `bash scripts/test.sh tests/integration` (the CLI and scripts in fresh processes).
set -euo pipefail
source "$(dirname "$0")/bootstrap.sh"
if [ "$#" -gt 0 ]; then
  exec python -m pytest -q "$@"
fi
# Test files run side by side in worker processes (pytest-xdist; a file's tests stay together and
# share their module fixtures): one worker per CPU, 2 to 4 (BERT_MP_TEST_WORKERS: another count; 0:
# one process). Every test holds on its own: no order, shared folder or port is assumed.
CPUS="$(python -c 'import os; print(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)')"
WORKERS="${BERT_MP_TEST_WORKERS:-$(( CPUS < 2 ? 2 : (CPUS > 4 ? 4 : CPUS) ))}"
# Every decision that turns on the CPU's capabilities is traced (bert_mp.core.numerics.precision,
# BERT_MP_CAPS_TRACE): the tests that took one run again below with every capability masked.
TRACE_DIR="$(mktemp -d)"
trap 'rm -rf "$TRACE_DIR"' EXIT
# The tests that act on a running process (marker `signals`) and the README's commands (`fresh`) start
# their commands as fresh processes, not forked from the suite's fork server (tests/forkserver.py,
# BERT_MP_TEST_FRESH in tests/conftest.py): an import or start-up bug the server's imports would hide
# fails here, in every CI run (the masked rerun below forks them: a server started under the mask
# imports under it). `BERT_MP_TEST_FORKSERVER=0 bash scripts/test.sh tests/integration` runs every
# command fresh.
BERT_MP_CAPS_TRACE="$TRACE_DIR/trace" BERT_MP_TEST_FRESH=1 \
  python -m pytest -q -n "$WORKERS" --dist loadfile --durations=15  # the slowest tests in the log
python tests/capability_trace.py "$TRACE_DIR/trace" >"$TRACE_DIR/args"
if [ ! -s "$TRACE_DIR/args" ]; then
  echo "[test] no test took a decision on the CPU's capabilities: the trace (BERT_MP_CAPS_TRACE) is broken" >&2
  exit 1
fi
echo
if python tests/capability_trace.py --is-the-masked-cpu; then
  echo "[test] this CPU is the one the masked rerun stands for (ATen's AVX2 kernels, no native bf16, fp16" \
    "or AMX): the run above was that run, so it is not repeated"
  exit 0
fi
echo "[test] again as on an AVX2-only CPU (BERT_MP_CPU_MASK=all, ATEN_CPU_CAPABILITY=avx2): the" \
  "$(wc -l <"$TRACE_DIR/args") tests and modules that took a decision on the CPU's capabilities"
# Its own inductor cache: with the cache the run above filled (kernels built for this CPU's ISA), a
# compiled-step test failed under ATEN_CPU_CAPABILITY=avx2 and passed with a fresh one.
if [ -n "${BERT_MP_TEST_CPU_REPORT:-}" ]; then  # the rerun's CPU seconds beside the first run's
  export BERT_MP_TEST_CPU_REPORT="${BERT_MP_TEST_CPU_REPORT%.json}.masked.json"
fi
BERT_MP_CPU_MASK=all ATEN_CPU_CAPABILITY=avx2 TORCHINDUCTOR_CACHE_DIR="$TRACE_DIR/inductor" \
  python -m pytest -q -n "$WORKERS" --dist loadfile "@$TRACE_DIR/args"
