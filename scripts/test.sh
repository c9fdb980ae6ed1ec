#!/usr/bin/env bash
# Install what is needed into .venv and run the test suite. With no arguments: the whole suite, then
# the precision / training / fine-tuning / fault tests again as on the weakest supported CPU (no
# bf16, no fp16, no AMX: BERT_MP_CPU_MASK=all), so a pass here means a pass on any CPU model.
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
python -m pytest -q -n "$WORKERS" --dist loadfile --durations=15  # the slowest tests in the log
echo
echo "[test] again with every CPU capability masked (BERT_MP_CPU_MASK=all): precision, train, finetune, faults"
BERT_MP_CPU_MASK=all python -m pytest -q -n "$WORKERS" --dist loadfile \
  tests/unit/core/test_precision.py tests/unit/pretrain/test_train.py \
  tests/unit/finetune/test_finetune.py tests/integration/test_finetune_cli.py \
  tests/unit/pretrain/test_faults.py tests/integration/test_fault_drill.py \
  tests/unit/sweep/test_diagnostics.py
