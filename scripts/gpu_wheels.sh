#!/usr/bin/env bash
# Download (here, where PyPI is reachable) the wheels the lent GPU machine lacks into .wheels/, for its
# Python (3.12, manylinux x86_64; override with GPU_PYTHON_VERSION=3.11 etc.). No dependencies are
# resolved here: scripts/gpu/install.py picks, on the GPU machine, the newest `datasets` whose
# requirements that machine's own packages (pyarrow, huggingface_hub, fsspec ...) satisfy, so
# three datasets releases are carried with the dill / multiprocess / fsspec each of them needs.
# omegaconf 2.4 needs no antlr4 runtime (2.3 needed antlr4-python3-runtime 4.9, an sdist only).
# pytest and its pure-Python requirements travel too: the tests phase must not assume the machine has it.
# pytorch-optimizer, torch-optimi and torchao: the optimizer and fp8 axes of a sweep (LAMB, Sophia, StableAdamW, Lion, fp8).
# The total must stay well under the 64 MiB that travels with the working tree (`carry`).
#   bash scripts/gpu_wheels.sh [DEST]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/.wheels}"
PYV="${GPU_PYTHON_VERSION:-3.12}"
ABI="cp${PYV//./}"
PIP=(python3 -m pip)
if [ -x "$ROOT/.venv/bin/python" ]; then PIP=("$ROOT/.venv/bin/python" -m pip); fi
SPECS=(
  datasets==5.2.0 datasets==4.8.5 datasets==4.0.0
  dill==0.4.1 dill==0.4.0 dill==0.3.8
  multiprocess==0.70.19 multiprocess==0.70.18 multiprocess==0.70.16
  fsspec==2026.9.0 fsspec==2026.2.0 fsspec==2025.3.0
  xxhash==3.6.0
  omegaconf==2.4.0
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0
  pytorch-optimizer==4.1.0 torch-optimi==0.3.3 torchao==0.18.0
)
mkdir -p "$DEST"
for spec in "${SPECS[@]}"; do
  name="${spec%%==*}"; version="${spec##*==}"
  if ls "$DEST"/"${name//-/_}"-"$version"-*.whl >/dev/null 2>&1; then continue; fi
  "${PIP[@]}" download -q --disable-pip-version-check --only-binary=:all: --no-deps \
    --python-version "$PYV" --implementation cp --abi "$ABI" --abi abi3 --abi none \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$DEST" "$spec"
done
bytes=$(du -sb "$DEST" | cut -f1)
echo "[gpu_wheels] $(ls "$DEST"/*.whl | wc -l) wheels, $((bytes / 1024)) KiB in $DEST (Python $PYV)"
if [ "$bytes" -gt $((48 * 1024 * 1024)) ]; then
  echo "[gpu_wheels] more than 48 MiB: with the working tree this may exceed the 64 MiB carry limit" >&2
  exit 1
fi
