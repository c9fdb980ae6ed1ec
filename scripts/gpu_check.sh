#!/usr/bin/env bash
# Check bert_mp on a machine with a CUDA GPU (docs/gpu.md): the CUDA tests, a benchmark row (BERT-base,
# seq 128: strict fp32 against bf16) and a short precision sweep with parity verdicts, within a time
# budget, every result written into OUT the moment it is measured.
#   bash scripts/gpu_check.sh OUT [--phases tests,bench,sweep] [--budget SECONDS] [--wheels DIR]
#   bash scripts/gpu_check.sh OUT --dry-run     # tiny shapes, on any device: the check's own plumbing
#   bash scripts/gpu_check.sh OUT --rehearse    # that dry run in a fresh copy of the repository (CI)
# Python: $PYTHON, else .venv's (bash scripts/bootstrap.sh installs the lock with a CUDA torch), else
# python3 with the machine's own torch. --wheels DIR (a machine without a package index): first
# installs what that Python lacks from the wheels scripts/gpu_wheels.sh downloaded, at the lock's
# versions, into .gpu_venv (a virtual environment that also sees that Python's packages, its torch too).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-}"
if [ -z "$PY" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
PY="${PY:-python3}"
ARGS=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    --wheels)
      [ "$#" -ge 2 ] || { echo "gpu_check.sh: error: --wheels needs a folder" >&2; exit 2; }
      WHEELS="$2"; shift 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
if [ -n "${WHEELS:-}" ]; then
  if [ ! -x .gpu_venv/bin/python ]; then  # the machine's own packages behind what is installed here
    "$PY" -m venv --without-pip .gpu_venv  # installed into by the machine's own pip (--python)
    SITE="$(.gpu_venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' >"$SITE/machine.pth"
  fi
  grep -v '^torch==' constraints.txt >.gpu_venv/constraints.txt
  DEPS="$("$PY" -c 'import tomllib; d = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(" ".join(x for x in d if not x.startswith("torch>")))')"
  # shellcheck disable=SC2086  # one argument per requirement
  "$PY" -m pip --python .gpu_venv/bin/python install -q --no-index --find-links "$WHEELS" \
    -c .gpu_venv/constraints.txt $DEPS pytest
  PY=.gpu_venv/bin/python
fi
export PYTHONPATH="$ROOT:$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}"  # bert_mp from the clone; gpu.check
exec "$PY" -m gpu.check "${ARGS[@]}"
