#!/usr/bin/env bash
# Install what is needed into .venv and run the test suite (extra arguments go to pytest).
set -euo pipefail
source "$(dirname "$0")/bootstrap.sh"
exec python -m pytest -q "$@"
