"""The GPU check (docs/gpu.md): ``bash scripts/gpu_check.sh OUT``, whose entry point is :mod:`.check`."""
