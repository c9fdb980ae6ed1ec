"""The ``profile`` phase: scripts/bench/profile_step.py over the encoder paths, each kernel's device time
summed into classes over the timed steps only."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gpu import settings
from gpu.child import child_env, read_json, run_child, status

PROFILE_PATHS = "padded,padded:bf16_pure,padded+compile,padded+compile:bf16_pure,unpad+compile,unpad"
"""The encoder paths in bf16, eager and compiled, and the padded ones in pure bf16 too (no autocast
casts, bf16 residual stream): which of the step's non-GEMM kernels compile and bf16 activations remove."""


def phase_profile(args: argparse.Namespace) -> dict[str, Any]:
    """scripts/bench/profile_step.py: where a bf16 step's device time goes, per encoder path (the timed steps
    only), each path written when profiled."""
    out = settings.STATE / "profile_step.json"
    out.unlink(missing_ok=True)
    if args.dry_run:
        size = ["--preset", "tiny", "--seq", "32", "--micro-batch", "4", "--steps", "1", "--warmup", "1"]
        size += ["--precision", "fp32", "--allow-emulated"]  # bf16_pure on any CPU, for the plumbing
    else:
        size = ["--preset", "base", "--seq", "128", "--micro-batch", str(args.micro_batch)]
        size += ["--steps", "6", "--warmup", "3", "--precision", "bf16"]
    env = child_env()
    if args.dry_run:
        env["TORCH_COMPILE_DISABLE"] = "1"  # the plumbing, not inductor on 2 cores
    rc, tail = run_child(
        [sys.executable, "scripts/bench/profile_step.py", *size, "--paths", PROFILE_PATHS, "--out", str(out)],
        args.budget,
        settings.STATE / "profile.log",
        tick=lambda: args.progress({"profile": read_json(out)}),
        env=env,
    )
    return {"status": status(rc), "rc": rc, "profile": read_json(out), "tail": tail[-1500:]}
