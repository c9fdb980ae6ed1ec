#!/usr/bin/env bash
# Install what is needed into .venv and run the test suite. With no arguments: the whole suite, then
# the precision / training / fine-tuning / fault tests again as on the weakest supported CPU (no
# bf16, no fp16, no AMX: BERT_MP_CPU_MASK=all), so a pass here means a pass on any CPU model.
# Extra arguments go to one pytest run instead, e.g. `bash scripts/test.sh -m slow`.
set -euo pipefail
source "$(dirname "$0")/bootstrap.sh"
if [ "$#" -gt 0 ]; then
  exec python -m pytest -q "$@"
fi
python -m pytest -q
echo
echo "[test] again with every CPU capability masked (BERT_MP_CPU_MASK=all): precision, train, finetune, faults"
BERT_MP_CPU_MASK=all python -m pytest -q \
  tests/test_precision.py tests/test_train.py tests/test_finetune.py tests/test_faults.py tests/test_diagnostics.py
