"""The GPU check's fixed facts: where it keeps its state, the phases and the order of commands docs/gpu.md
gives, each phase's budget, the wheels a bare machine lacks, the ladder's targets."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STATE = ROOT / "runs" / "gpu_check"
SITE = ROOT / ".gpu_site"
INSTALLED = "INSTALLED.json"
"""Written into SITE by a successful install: a command that finds it skips the install."""
WHEELS = ROOT / ".wheels"
CARRIED_DIR = ".gpu_cache"
"""Where a command finds what the previous one packed for it (git-ignored, so ``carry`` can take it)."""
PHASES = (
    "install",
    "levers",
    "large",
    "ladder",
    "paths",
    "tests",
    "kernels",
    "profile",
    "compile",
    "sweep",
    "summary",
)
DEFAULT_PHASES = ("ladder", "tests")
COMMANDS = (
    ("sweep",),
    ("levers",),
    ("large",),
    ("tests", "kernels", "profile"),
    ("compile",),
    ("ladder", "paths"),
)
"""The sequence docs/gpu.md gives: one command each, each on a fresh machine (install is implied); a
lease of 15 minutes holds the first two, the third if time remains."""
BUDGETS = {
    "install": 60.0,
    "levers": 360.0,
    "large": 420.0,
    "ladder": 240.0,
    "paths": 300.0,
    "tests": 180.0,
    "kernels": 90.0,
    "profile": 200.0,
    "compile": 300.0,
    "sweep": 420.0,
}
"""Seconds per phase on a GPU machine (each command stays under ``DEADLINE_S``)."""
BUDGETS_DRY = {
    "install": 60.0,
    "levers": 150.0,
    "large": 150.0,
    "ladder": 120.0,
    "paths": 120.0,
    "tests": 120.0,
    "kernels": 60.0,
    "profile": 90.0,
    "compile": 120.0,
    "sweep": 150.0,
}
ROWS = {
    "levers": "levers",
    "large": "large",
    "ladder": "ladder",
    "paths": "paths",
    "tests": "tests",
    "kernels": "kernel_check",
    "profile": "profile",
    "compile": "ladder_compiled",
    "sweep": "sweep_runs",
}
"""Where summary.json keeps what each phase measured: a phase cut at its budget with nothing there
produced nothing within it (a hang, or a budget no machine meets), which the rehearsal fails on."""
DEADLINE_S = 450.0
"""One command's wall time: 7.5 minutes, under the 10-minute limit with the machine's start."""
RESERVE_S, MIN_PHASE_S, TICK_S = 15.0, 30.0, 5.0
MAX_OUT_FILES = 8
LOG_NAME, LOG_CAP = "gpu_check.log", 200_000
GPU_TESTS = (
    "tests/unit/pretrain/test_gpu.py",
    "tests/integration/test_gpu_resume.py",
    "tests/unit/core/test_cuda_paths.py",
    "tests/unit/pretrain/test_sync_budget.py",
)
TESTS_K_ENV = "BERT_MP_GPU_CHECK_TESTS_K"
"""If set, a ``pytest -k`` expression for the ``tests`` phase: the CPU rehearsal runs the phase's
plumbing on a few of GPU_TESTS' CPU tests (the suite itself runs all of them)."""
CARRIED = (
    "datasets",
    "dill",
    "multiprocess",
    "xxhash",
    "fsspec",
    "omegaconf",
    "pytest",
    "pluggy",
    "iniconfig",
    "pygments",
    "pytorch-optimizer",
    "torch-optimi",
    "torchao",
)
WANTED = ("datasets", "omegaconf", "pytest", "pytorch-optimizer", "torch-optimi", "torchao")
TARGETS = {
    "bf16_mfu_min": 0.45,
    "tf32_speedup_min": 3.0,
    "bf16_speedup_min": 5.0,
    "fp16_vs_bf16_max_gap": 0.05,
}
"""The precision ladder's targets on an H100 (BERT-base, seq 128): speed-ups against strict fp32."""
