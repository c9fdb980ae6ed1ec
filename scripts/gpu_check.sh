#!/usr/bin/env bash
# Validate bert_mp on a bare GPU machine, from the repo root, with the machine's own torch:
#   bash scripts/gpu_check.sh OUT_DIR [install|tests|ladder|compile|sweep|summary|all ...] [--dry-run] [--force]
# Default phases: install tests ladder summary. Needs .wheels/ (bash scripts/gpu_wheels.sh, run where
# PyPI is reachable) when the machine lacks datasets / omegaconf. See docs/gpu.md.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
