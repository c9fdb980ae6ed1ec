#!/usr/bin/env bash
# For a GPU machine without a package index: download here (where PyPI is reachable) a wheel of every
# package of constraints.txt except torch (the GPU machine's own torch is used) into DEST, for the GPU
# machine's Python and platform; then, there, `bash scripts/gpu_check.sh OUT --wheels DEST`.
#   bash scripts/gpu_wheels.sh [DEST]     # default .wheels/ (ignored by git)
#   GPU_PYTHON_VERSION=3.12 GPU_PLATFORM=manylinux_2_28_x86_64 bash scripts/gpu_wheels.sh
# deepspeed (an sdist, used by the CPU suite only) is left out.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/.wheels}"
PYV="${GPU_PYTHON_VERSION:-3.12}"
PLATFORM="${GPU_PLATFORM:-manylinux_2_28_x86_64}"
PY=python3
if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; fi
REQ="$(mktemp)"
trap 'rm -f "$REQ"' EXIT
grep -v '^#\|^torch==\|^deepspeed==' "$ROOT/constraints.txt" >"$REQ"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$PYV" --platform "$PLATFORM" --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 -d "$DEST" -r "$REQ"
echo "[gpu_wheels] $(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST (Python $PYV)"
