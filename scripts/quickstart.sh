#!/usr/bin/env bash
# Install what is needed into .venv, then prepare the built-in corpus, train, and report.
set -euo pipefail
source "$(dirname "$0")/bootstrap.sh"
bert-mp prepare configs/quickstart.yaml "$@"
bert-mp train configs/quickstart.yaml "$@"
