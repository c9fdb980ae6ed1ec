#!/usr/bin/env bash
# Create .venv (once) and install bert_mp with its dependencies into it. Sourced by the other scripts.
# BERT_MP_TORCH overrides the torch requirement (default: the pinned release we test with; on PyPI
# that is the CUDA build on Linux, so GPU users get a GPU torch).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${BERT_MP_VENV:-$ROOT/.venv}"
PYTHON_BIN="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[bootstrap] creating virtual environment in $VENV"
  "$PYTHON_BIN" -m venv "$VENV"
fi
PY="$VENV/bin/python"
STAMP="$VENV/.bert_mp_installed"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ scripts/bootstrap.sh -nt "$STAMP" ]; then
  echo "[bootstrap] installing dependencies (first run: a minute or two)"
  # pip's and setuptools' own output goes to a log, shown only when the installation fails
  LOG="$VENV/install.log"
  if ! {
    "$PY" -m pip install -q --disable-pip-version-check --upgrade pip &&
      "$PY" -m pip install -q --disable-pip-version-check "${BERT_MP_TORCH:-torch==2.13.0}" &&
      "$PY" -m pip install -q --disable-pip-version-check -e ".[dev]"
  } >"$LOG" 2>&1; then
    cat "$LOG" >&2
    echo "[bootstrap] installation failed (log above, also in $LOG)" >&2
    return 1 2>/dev/null || exit 1
  fi
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
export HF_HUB_DISABLE_TELEMETRY=1
