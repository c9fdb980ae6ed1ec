#!/usr/bin/env bash
# Validate bert_mp on a bare GPU machine, from the repo root, with the machine's own torch. The
# commands docs/gpu.md gives, in order, each on a fresh machine (carry .wheels from scripts/gpu_wheels.sh):
#   bash scripts/gpu_check.sh OUT ladder paths
#   bash scripts/gpu_check.sh OUT tests kernels profile
#   bash scripts/gpu_check.sh OUT compile
#   bash scripts/gpu_check.sh OUT sweep
# Every command installs what it needs when .gpu_site/ has no install, keeps to its phase budgets,
# and writes each result into OUT as it is measured (at most 8 files).
#   bash scripts/gpu_check.sh OUT --rehearse   # that sequence on this CPU, tiny shapes, fresh each time
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}"  # its rooms import as packages (gpu.*)
exec "${PYTHON:-python3}" -m gpu.check "$@"
