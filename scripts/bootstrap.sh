#!/usr/bin/env bash
# Create .venv (once) and install bert_mp with its dependencies into it. Sourced by the other scripts.
# Locked by default: every package at the version of constraints.txt, the versions the suite passed
# with (docs/testing.md#the-locked-install). BERT_MP_UNLOCKED=1 installs the newest releases that
# pyproject.toml allows instead. BERT_MP_TORCH sets the torch requirement (any pip requirement; the
# lock's torch line then steps aside). The install stamp records which of these it was, and a change of
# either, of pyproject.toml, constraints.txt or this script installs again.
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
if [ "${BERT_MP_UNLOCKED:-0}" = 1 ]; then MODE="unlocked"; else MODE="locked"; fi
WANT="$MODE torch=${BERT_MP_TORCH:-}"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ] || [ pyproject.toml -nt "$STAMP" ] ||
  [ constraints.txt -nt "$STAMP" ] || [ scripts/bootstrap.sh -nt "$STAMP" ]; then
  echo "[bootstrap] installing dependencies (first run: a minute or two)"
  PIP=("$PY" -m pip install -q --disable-pip-version-check)
  if [ "$MODE" = locked ]; then
    LOCK="$ROOT/constraints.txt"
    if [ -n "${BERT_MP_TORCH:-}" ]; then  # the lock without its torch line
      LOCK="$VENV/constraints.txt"
      grep -v '^torch==' "$ROOT/constraints.txt" >"$LOCK"
    fi
    PIP+=(-c "$LOCK")
  else
    PIP+=(--upgrade --upgrade-strategy eager)
  fi
  # pip's and setuptools' own output goes to a log, shown only when the installation fails
  LOG="$VENV/install.log"
  if ! {
    "$PY" -m pip install -q --disable-pip-version-check --upgrade pip &&
      "${PIP[@]}" "${BERT_MP_TORCH:-torch}" && "${PIP[@]}" -e ".[dev]"
  } >"$LOG" 2>&1; then
    cat "$LOG" >&2
    echo "[bootstrap] installation failed (log above, also in $LOG)" >&2
    return 1 2>/dev/null || exit 1
  fi
  echo "$WANT" >"$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
export HF_HUB_DISABLE_TELEMETRY=1
