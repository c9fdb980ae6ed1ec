#!/usr/bin/env python
"""What bf16 / fp16 cost on this CPU: a square matmul per dtype against fp32, interleaved rounds.

Prints the CPU's reduced-precision capabilities (after ``BERT_MP_CPU_MASK``) and, per dtype, the
median time and the median per-round ratio to fp32 (each round times every dtype back to back, so
a slow phase of a shared machine hits both sides of a ratio). Where the CPU lacks native support the
ratio is the cost of torch's emulation, the figure behind ``hardware.allow_emulated``'s warning.

    python scripts/bench/cpu_precision.py --size 512 --rounds 7 --out docs/benchmarks/cpu_precision.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

from bert_mp.core.numerics.precision import cpu_capabilities, device_name, library_versions

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: its rooms import as packages
from bench.harness import write_report  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def time_matmul(a: torch.Tensor, b: torch.Tensor, min_seconds: float) -> float:
    """Seconds per product, repeated until ``min_seconds`` have passed (after one warm-up call)."""
    a @ b
    n, start = 0, time.perf_counter()
    while True:
        a @ b
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--min-seconds", type=float, default=0.3, help="timing per dtype per round")
    p.add_argument("--out", type=Path, default=Path("runs/bench_cpu_precision.json"))
    args = p.parse_args(argv)

    torch.manual_seed(0)
    base = (torch.randn(args.size, args.size), torch.randn(args.size, args.size))
    operands = {k: (base[0].to(dt), base[1].to(dt)) for k, dt in DTYPES.items()}
    rounds = []
    for r in range(args.rounds):
        names = list(DTYPES) if r % 2 == 0 else list(DTYPES)[::-1]
        rounds.append({k: time_matmul(*operands[k], args.min_seconds) for k in names})
    caps = cpu_capabilities()
    results = {}
    for k in DTYPES:
        ratios = [rd[k] / rd["fp32"] for rd in rounds]
        results[k] = {
            "median_ms": 1000 * statistics.median(rd[k] for rd in rounds),
            "ratio_vs_fp32": statistics.median(ratios),
            "ratio_min_max": [min(ratios), max(ratios)],
            "native": k == "fp32" or caps.has(k),
        }
    report = {
        "what": f"{args.size}x{args.size} matmul, median of {args.rounds} interleaved rounds",
        "date": date.today().isoformat(),
        "cpu": device_name(torch.device("cpu")),
        "cpu_capabilities": caps.as_dict(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "versions": library_versions(),
        "command": "python scripts/bench/cpu_precision.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "results": results,
    }
    write_report(report, args.out)
    print(f"{report['cpu']} ({report['torch_cpu_capability']}), capabilities {caps.as_dict()}")
    for k, v in results.items():
        lo, hi = v["ratio_min_max"]
        how = "native" if v["native"] else "emulated"
        print(f"{k:>5}: {v['median_ms']:8.2f} ms  {v['ratio_vs_fp32']:6.1f}x fp32 ({lo:.1f}-{hi:.1f}), {how}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
